"""The job's ground: a case as the policy reads it, a plan as it writes it, the metric it is judged by."""
