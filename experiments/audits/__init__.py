"""Audits of the environment and the rewards: what an optimiser can exploit, what the oracle and the
baselines score, how robust plans are; each script prints what it measured."""
