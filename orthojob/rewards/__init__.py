"""Text to plan to scores: parsing, cached rollouts, the five GRPO rewards and their canaries."""
