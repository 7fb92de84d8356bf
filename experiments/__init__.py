"""Research run on the product package from a checkout (not installed with it; nothing in the product
imports it): the learning experiment (:mod:`experiments.learning`) and the environment and reward
audits (:mod:`experiments.audits`)."""
