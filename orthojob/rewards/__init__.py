"""Plan to scores: the cached rollouts, the five GRPO rewards, their advantage and canaries."""
