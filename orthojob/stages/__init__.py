"""The stages: each stage's config, trainer and job, the presets, the pipeline and the gates."""
