"""Running as a job: storage, tracking, progress, identity, checkpoints, preemption, exit codes."""
