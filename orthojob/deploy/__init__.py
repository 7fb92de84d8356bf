"""Running the job on a cluster: the Job's manifests, the cluster commands and the multi-node launcher."""
