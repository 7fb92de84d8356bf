"""The pipeline's summary: pipeline_summary.json's fields, printed as the table a run ends with."""

from __future__ import annotations

from typing import Any

from orthojob.core.metrics import BANDS, HARD_RULE_SHARE, SCALED_REWARD_MEAN
from orthojob.stages.presets import DEFAULT_STAGES

GATE_VIEW: tuple[str, ...] = (
    "parse_rate", "format_reward", SCALED_REWARD_MEAN, f"uniform_slerp_{SCALED_REWARD_MEAN}",
    f"oracle_{SCALED_REWARD_MEAN}", "margin_over_slerp", "margin_over_slerp_lower", "p_no_better_than_slerp", HARD_RULE_SHARE, f"oracle_{HARD_RULE_SHARE}",
    f"{HARD_RULE_SHARE}_over_oracle", "strategy_accuracy", "truncated_rate", "mean_completion_tokens", "eval_seconds",
    "tool_call_rate", "finished_rate", "valid_call_rate", "reward_mean",
    "engine", f"raw_{SCALED_REWARD_MEAN}", f"raw_{HARD_RULE_SHARE}", "repair_share", "fallback_share",
    "repaired_movement_share",
)  # fmt: skip
"""The gate metrics a stage's row of the summary shows."""


def gate_view(content: dict) -> dict:
    """A gate file's entry in the summary: its verdict, checks and :data:`GATE_VIEW` metrics."""
    m = content.get("metrics", {})
    return {"passed": content.get("passed"), "checks": content.get("checks")} | {
        k: m.get(k) for k in GATE_VIEW
    }


def _fmt(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def format_summary(summary: dict) -> str:
    """The pipeline's table: one row per stage with its wall time and key numbers."""
    s = summary["stages"]
    lines = [f"Pipeline {summary['preset']}: {_fmt(summary.get('wall_seconds'), '.0f')} s, exit {summary.get('exit_code')}",
             f"(scaled_reward: the scaled terminal reward, {BANDS}; hard rules: share of plans breaking one)",
             f"{'stage':<15}{'seconds':>9}  result", "-" * 100]  # fmt: skip
    if "tiny-model" in s:
        lines.append(
            f"{'tiny-model':<15}{_fmt(s['tiny-model']['seconds'], '9.1f')}  {s['tiny-model']['path']}"
        )
    if "base" in s:
        x = s["base"]
        lines.append(
            f"{'base':<15}{_fmt(x['seconds'], '9.1f')}  before training: parse {_fmt(x['parse_rate'])}, format "
            f"{_fmt(x['format_reward'])}, scaled_reward {_fmt(x.get(SCALED_REWARD_MEAN))}"
        )
    for name in summary.get("chain") or DEFAULT_STAGES:
        x = s.get(name)
        if x is None:
            continue
        if "skipped" in x:
            lines.append(f"{name:<15}{'':>9}  skipped: {x['skipped']}")
            continue
        if "resumed_from" in x and "steps" not in x:  # an earlier attempt trained it; no record of how
            lines.append(
                f"{name:<15}{'':>9}  resumed from {x['resumed_from']} (trained by an earlier attempt)"
            )
        elif name == "grpo":
            lines.append(
                f"{'grpo':<15}{_fmt(x['seconds'], '9.1f')}  exit {x['exit_code']}, {x.get('steps', 0)} steps, "
                f"reward mean {_fmt(x.get('reward_mean'))} (first half {_fmt(x.get('reward_first_half_mean'))}, "
                f"second half {_fmt(x.get('reward_second_half_mean'))}), {_fmt(x.get('step_time_mean'), '.2f')} s/step"
            )
        elif "error" in x:
            lines.append(
                f"{name:<15}{_fmt(x['seconds'], '9.1f')}  exit {x.get('exit_code')}: {x['error'][:200]}"
            )
        else:
            demos = x.get("demos") or {}
            what = f"{x['examples']} {demos.get('source', '')} demos"
            if "filtered_hard_rule" in demos:
                what += f" ({demos['filtered_hard_rule']} unsafe filtered)"
            if "rsft" in x:
                what = f"{x['rsft']['kept']} kept of {x['rsft']['samples']} samples"
            lines.append(
                f"{name:<15}{_fmt(x['seconds'], '9.1f')}  {x['steps']} steps, {what}, loss "
                f"{_fmt(x['first_loss'])} -> {_fmt(x['final_loss'])}, token acc {_fmt(x['final_token_accuracy'])}, "
                f"{x['parameters']['trainable']:,} trainable params"
            )
        key = f"gate_{name}"
        if key in s:
            g = s[key]
            if name == "tool_sft":
                lines.append(
                    f"{key:<15}{_fmt(g['seconds'], '9.1f')}  {'PASSED' if g['passed'] else 'FAILED'}: tool calls "
                    f"{_fmt(g['tool_call_rate'])}, finished {_fmt(g['finished_rate'])}, valid calls "
                    f"{_fmt(g['valid_call_rate'])}, reward {_fmt(g['reward_mean'])}"
                )
            else:
                lines.append(
                    f"{key:<15}{_fmt(g['seconds'], '9.1f')}  {'PASSED' if g['passed'] else 'FAILED'}: parse "
                    f"{_fmt(g['parse_rate'])}, format {_fmt(g['format_reward'])}, scaled_reward "
                    f"{_fmt(g.get(SCALED_REWARD_MEAN))} (SLERP {_fmt(g.get(f'uniform_slerp_{SCALED_REWARD_MEAN}'))}, "
                    f"oracle {_fmt(g.get(f'oracle_{SCALED_REWARD_MEAN}'))}), hard rules {_fmt(g.get(HARD_RULE_SHARE))} "
                    f"(oracle {_fmt(g.get(f'oracle_{HARD_RULE_SHARE}'))}), strategy acc {_fmt(g['strategy_accuracy'])}"
                )  # fmt: skip
                if g.get("p_no_better_than_slerp") is not None:
                    lines.append(
                        f"{'':<24}  above SLERP on the same cases by {_fmt(g.get('margin_over_slerp'))} (95 % lower "
                        f"bound {_fmt(g.get('margin_over_slerp_lower'))}, p {_fmt(g['p_no_better_than_slerp'], '.2g')})"
                    )
                if g.get("engine") not in (None, "off"):
                    lines.append(f"{'':<24}  {engine_line(g)}")
    if "evaluate" in s:
        x = s["evaluate"]
        terms = ", ".join(
            f"{p} {_fmt(v)} ({_fmt((x.get(HARD_RULE_SHARE) or {}).get(p))})"
            for p, v in x[SCALED_REWARD_MEAN].items()
        )
        lines.append(f"{'evaluate':<15}{_fmt(x['seconds'], '9.1f')}  scaled_reward (hard rules): {terms}")
        for p, m in (x.get("model_metrics") or {}).items():
            if m.get("engine") not in (None, "off"):
                lines.append(f"{'':<24}  {p}: {engine_line(m)}")
    return "\n".join(lines)


def engine_line(m: dict) -> str:
    """The executed plans' figures beside the raw plans' (:func:`orthojob.eval.evaluation.engine_metrics`)."""
    return (
        f"engine v{m['engine']}: executed scaled_reward {_fmt(m.get(SCALED_REWARD_MEAN))}, hard rules "
        f"{_fmt(m.get(HARD_RULE_SHARE))} | raw plans: scaled_reward {_fmt(m.get(f'raw_{SCALED_REWARD_MEAN}'))}, "
        f"hard rules {_fmt(m.get(f'raw_{HARD_RULE_SHARE}'))}, repaired {_fmt(m.get('repair_share'))} of plans "
        f"(fallback {_fmt(m.get('fallback_share'))}), {_fmt(m.get('repaired_movement_share'))} of the movement"
    )
