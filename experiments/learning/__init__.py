"""The learning experiment (``make learn``): does GRPO on the environment's reward teach a small model
to plan? Its settings (:mod:`.config`), its run (:mod:`.experiment`), its evaluation and report, and the
analyses of finished runs; the lab notebook is NOTEBOOK.md beside them."""
