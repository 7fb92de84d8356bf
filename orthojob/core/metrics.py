"""The metric a planner is judged by, everywhere: the scaled terminal reward, and the hard-rule share.

Every place that judges or reports a planner (the gates, ``orthojob evaluate``, the pipeline
summary, ``make learn``, the promotion to ``champion``, MLflow) names these, from here:

* :data:`SCALED_REWARD` (``scaled_reward``): the **headline metric**, the scaled terminal reward of
  :mod:`server.reward_scaler` that ``reward_terminal`` pays GRPO. Its bands are stated once, in that
  module (and :data:`BANDS` renders them from its constants): safe plans ``8 * raw`` in [0, 8]
  (doing nothing 0), plans breaking a hard rule in (-2, -0.25], a completion that is not a plan -2.
  A mean over held-out cases is ``scaled_reward_mean`` (:func:`mean_of`).
* :data:`HARD_RULE_SHARE` (``hard_rule_share``): the share of held-out cases whose plan breaks a hard
  rule (collision, PDL stress, per-stage limits). A completion that is no plan breaks none (it scores
  -2, and the parse rate bounds it). Every quality gate bounds it against the oracle's on the same
  cases (``hard_rule_share_over_oracle``).
* :data:`TERMINAL_RAW` (``terminal_raw``): the environment's raw terminal score in [0, 1], before
  scaling. Secondary: shown for reference, never compared by a gate, a promotion or a verdict (on it
  a rule-breaking plan can outscore a safe one; the server's results call it ``terminal_reward``).
"""

from __future__ import annotations

from server.reward_scaler import FAIL_TOP, REWARD_MAX, REWARD_MIN, SAFE_SCALE

SCALED_REWARD: str = "scaled_reward"
"""The headline metric: the scaled terminal reward in [REWARD_MIN, REWARD_MAX]."""
HARD_RULE_SHARE: str = "hard_rule_share"
"""Share of the cases whose plan breaks a hard rule."""
TERMINAL_RAW: str = "terminal_raw"
"""The raw terminal score in [0, 1] (secondary)."""

# the gate as MLflow records it, on the stage run and on its gated LoggedModel
GATE_PASSED_TAG = "orthorl.gate_passed"
"""The gate's verdict (``true``/``false``), a tag of the stage run and of its gated LoggedModel."""
GATE_STAGE_TAG = "orthorl.gate_stage"
"""The stage whose gate a LoggedModel carries (``bc_sft``, ``grpo``, ...)."""
ENGINE_TAG = "staging_engine"
"""The staging engine's version a gate judged the executed plans with (``off``: the raw plans were
judged): a gate metric, a tag of the gated LoggedModel (``orthorl.staging_engine``) and of a registered
model version (``staging_engine``). What ships is the planner with that engine."""
GATE_METRIC_PREFIX = "gate/"
"""A gate's metrics on the run and on its LoggedModel: ``gate/<name>`` (e.g. ``gate/scaled_reward_mean``)."""
EXCESS_METRIC = f"{HARD_RULE_SHARE}_over_oracle"
"""The hard-rule share minus the oracle's on the gate's cases (a gate metric; promotion filters on it)."""

BANDS: str = (
    f"safe {SAFE_SCALE:g}*raw in [0, {REWARD_MAX:g}], breaks a hard rule in ({REWARD_MIN:g}, {FAIL_TOP:g}], "
    f"not a plan {REWARD_MIN:g}"
)
"""The scaled reward's bands in one line, from :mod:`server.reward_scaler`'s constants (for tables)."""


def mean_of(metric: str) -> str:
    """The name of ``metric``'s mean over held-out cases: ``scaled_reward`` -> ``scaled_reward_mean``."""
    return f"{metric}_mean"


SCALED_REWARD_MEAN: str = mean_of(SCALED_REWARD)
"""``scaled_reward_mean``: a gate's headline, and the promotion's comparison metric."""

__all__ = ["BANDS", "HARD_RULE_SHARE", "SCALED_REWARD", "SCALED_REWARD_MEAN", "TERMINAL_RAW", "mean_of"]
