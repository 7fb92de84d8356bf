"""Models: loading policies and checkpoints, base weights, the offline tiny model."""
