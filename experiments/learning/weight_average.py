"""GRPO's weights averaged over its steps: :class:`WeightAverage`, what ``python -m experiments.learning
--bc-ema`` evaluates and saves in place of the weights as trained (experiments/learning/NOTEBOOK.md)."""

from __future__ import annotations

import contextlib

import torch


class WeightAverage:
    """An exponential moving average of a policy's trainable weights over GRPO's steps (Polyak
    averaging): after each step ``avg = decay * avg + (1 - decay) * weights``, starting from the weights
    at the first step. ``decay`` 0 keeps nothing and every method leaves the model as it is. A decay
    of 0.9 averages over about the last 10 steps, which damps the step-to-step swing of a
    near-deterministic policy without holding it near its start (0.9**30 < 0.05 of the start is left
    after 30 steps)."""

    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the weight average's decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.weights: dict[str, torch.Tensor] = {}

    def _params(self, model):
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def start(self, model) -> None:
        if self.decay:
            self.weights = {n: p.detach().clone() for n, p in self._params(model)}

    @torch.no_grad()
    def update(self, model) -> None:
        for n, p in self._params(model) if self.weights else ():
            self.weights[n].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def copy_into(self, model) -> None:
        for n, p in self._params(model) if self.weights else ():
            p.copy_(self.weights[n])

    @contextlib.contextmanager
    def swapped_in(self, model):
        """The average in ``model`` inside the block, the trained weights back after it."""
        if not self.weights:
            yield
            return
        trained = {n: p.detach().clone() for n, p in self._params(model)}
        self.copy_into(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self._params(model):
                    p.copy_(trained[n])
