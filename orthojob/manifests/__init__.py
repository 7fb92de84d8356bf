"""Package data: a copy of k8s/grpo-job.yaml, so that ``orthojob k8s`` works from an installed
wheel (tests/test_deploy.py checks the copy equals the original; refresh it with
``cp k8s/grpo-job.yaml orthojob/manifests/``)."""
