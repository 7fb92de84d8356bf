"""Running as a job: storage, tracking, the registry, identity, preemption, exit codes, Kubernetes."""
