"""Stage 4, rejection fine-tuning (RSFT): ``orthojob rsft --from-checkpoint DIR --out DIR``.

1. **Pre-flight**: ``--from-checkpoint`` must carry a passed gate of any earlier stage (format SFT,
   BC, GRPO or RSFT; :func:`orthojob.lifecycle.gate_file.check_gate`), whose digest still matches.
2. **Sample**: for each of ``prompts`` training prompts (seeds from ``prompt_seed_start``, tasks
   taking turns, never held-out seeds; with ``cases``, a case set's training patients' cases, each
   once, :func:`prompt_keys`) the checkpoint samples ``samples_per_prompt`` (k) completions
   at ``temperature`` (:func:`orthojob.eval.evaluation.generate_completions`).
3. **Score** every completion with the environment exactly as the GRPO rewards do
   (:func:`orthojob.rewards.rollouts.score_texts`): the scaled terminal reward of :mod:`server.reward_scaler`
   (safe plans in [0, 8], plans that break a hard rule in (-2, -0.25], a completion that is not a
   plan -2), and uniform SLERP's scaled reward on the same case for reference.
4. **Keep** (:class:`KeepRule`, :func:`select`), per prompt: a completion is *eligible* when it
   parses into a plan, breaks no hard clinical rule (collision, PDL stress, per-stage limits), scores
   strictly above ``keep_min_reward`` (default 0, doing nothing's score) and, when
   ``keep_min_margin_over_slerp`` is set, at least uniform SLERP's score on the case plus that margin.
   Of the eligible completions (identical texts counted once) the ``keep_per_prompt`` best by scaled
   reward are kept (default 1: best-of-k; ties go to the earlier sample); a prompt with none keeps
   nothing. So every kept completion breaks no hard rule and scores at least as well as every
   dropped completion of its prompt (other than a copy of a kept one).
5. **Fine-tune** the checkpoint on the kept (prompt, completion) pairs with the one SFT routine
   (:func:`orthojob.stages.sft.run_sft`), then **gate** it (stage ``rsft``: by default the format thresholds and
   a hard-rule share no higher than the oracle's).

``--out`` receives the model, ``rsft_samples.jsonl`` (every sample: prompt case, completion, scores,
kept or why dropped), ``sft_log.json`` whose summary holds the counts (``rsft``: prompts, samples,
not_a_plan, hard_rule, below_threshold, below_slerp, duplicate, not_best, kept, prompts_kept) and the
gate file. The counts are the stage run's ``rsft/*`` metrics in MLflow. When nothing is kept the
stage stops with exit 2 (a configuration to change: threshold, k, temperature, or a better checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orthojob.core.prompts import build_messages, prompt_format_of, reset_observation
from orthojob.data import case_sets
from orthojob.eval.evaluation import UNIFORM_SLERP_PLAN, generate_completions
from orthojob.lifecycle import gate_file
from orthojob.modeling import models
from orthojob.ops import storage, tracking
from orthojob.ops.exit_codes import ExitCode
from orthojob.rewards.rollouts import score_texts
from orthojob.stages import gate
from orthojob.stages.rsft_config import RSFT_SAMPLES_FILE, ConfigError, RSFTConfig
from orthojob.stages.sft import (
    add_sft_arguments,
    config_from_args,
    gate_settings_for,
    localize,
    log_stage,
    run_sft,
)
from server.cases import CaseKey
from server.treatment import score_plans

log = logging.getLogger(__name__)

DROP_REASONS: tuple[str, ...] = (
    "not_a_plan",
    "hard_rule",
    "below_threshold",
    "below_slerp",
    "duplicate",
    "not_best",
)
"""Why a sample was not kept, in the order the keep rule checks."""


class RSFTError(Exception):
    """RSFT cannot fine-tune: ``exit_code`` and a message that says what to change."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


@dataclass(frozen=True)
class KeepRule:
    """The keep rule (module docstring, step 4)."""

    min_reward: float = 0.0
    min_margin_over_slerp: float | None = None
    keep_per_prompt: int = 1

    @classmethod
    def of(cls, config: RSFTConfig) -> KeepRule:
        return cls(config.keep_min_reward, config.keep_min_margin_over_slerp, config.keep_per_prompt)

    def ineligible(self, sample: dict) -> str | None:
        """Why ``sample`` (its ``error``, ``broken_rules``, ``scaled_reward``, ``slerp_scaled_reward``)
        cannot be kept, or None when it is eligible."""
        if sample["error"] is not None:
            return "not_a_plan"
        if sample["broken_rules"]:
            return "hard_rule"
        if not sample["scaled_reward"] > self.min_reward:
            return "below_threshold"
        if (
            self.min_margin_over_slerp is not None
            and not sample["scaled_reward"] >= sample["slerp_scaled_reward"] + self.min_margin_over_slerp
        ):
            return "below_slerp"
        return None


def select(samples: Sequence[dict], rule: KeepRule) -> list[dict]:
    """``samples`` (dicts with ``prompt_index``, ``sample``, ``completion`` and the scores) with
    ``kept`` (bool) and ``dropped`` (a :data:`DROP_REASONS` entry, or None when kept) set, by the
    keep rule: per prompt, the ``keep_per_prompt`` best eligible distinct completions."""
    out = [dict(s) for s in samples]
    by_prompt: dict[int, list[dict]] = {}
    for s in out:
        s["kept"], s["dropped"] = False, rule.ineligible(s)
        by_prompt.setdefault(s["prompt_index"], []).append(s)
    for group in by_prompt.values():
        eligible = sorted(
            (s for s in group if s["dropped"] is None), key=lambda s: (-s["scaled_reward"], s["sample"])
        )
        seen: set[str] = set()
        for s in eligible:
            if s["completion"] in seen:
                s["dropped"] = "duplicate"
            elif len(seen) >= rule.keep_per_prompt:
                s["dropped"] = "not_best"
            else:
                seen.add(s["completion"])
                s["kept"] = True
    return out


def counts(samples: Sequence[dict]) -> dict:
    """How many samples were kept and why the others were dropped, and the reward means."""
    kept = [s for s in samples if s["kept"]]
    prompts = {s["prompt_index"] for s in samples}
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else None  # noqa: E731
    best = [max(s["scaled_reward"] for s in samples if s["prompt_index"] == p) for p in sorted(prompts)]
    return {
        "prompts": len(prompts),
        "samples": len(samples),
        **{reason: sum(s["dropped"] == reason for s in samples) for reason in DROP_REASONS},
        "kept": len(kept),
        "prompts_kept": len({s["prompt_index"] for s in kept}),
        "sample_reward_mean": mean([s["scaled_reward"] for s in samples]),
        "best_of_k_reward_mean": mean(best),
        "kept_reward_mean": mean([s["scaled_reward"] for s in kept]),
        "slerp_reward_mean": mean([s["slerp_scaled_reward"] for s in samples]),
    }


def prompt_cases(config: RSFTConfig) -> list[tuple[str, int]]:
    """``(task_id, seed)`` of the generated training prompts: tasks take turns, seeds from
    ``prompt_seed_start``."""
    tasks = list(config.task_ids)
    return [
        (tasks[k % len(tasks)], config.prompt_seed_start + k // len(tasks)) for k in range(config.prompts)
    ]


def prompt_keys(config: RSFTConfig) -> tuple[list[CaseKey], list[str | None]]:
    """The training prompts' cases and their case ids: with ``config.cases`` the case set's training
    patients' cases (each once, in file order, at most ``prompts``), else :func:`prompt_cases`' generated
    seeds (no case ids)."""
    if config.cases is None:
        keys = [CaseKey(task_id, seed, config.force_decay) for task_id, seed in prompt_cases(config)]
        return keys, [None] * len(keys)
    loaded = case_sets.load_case_set(config.cases, config.heldout_share, config.force_decay)
    return loaded.train[: config.prompts], loaded.case_ids("train")[: config.prompts]


def sample_completions(config: RSFTConfig, checkpoint: str | Path, observations: Sequence[dict]) -> list[str]:
    """k sampled completions per observation from ``checkpoint`` (prompt-major)."""
    import torch

    model, tokenizer = models.load_for_inference(checkpoint)
    torch.manual_seed(config.seed)
    texts, _counts, _ended = generate_completions(
        model,
        tokenizer,
        observations,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.sample_batch_size,
        samples=config.samples_per_prompt,
        temperature=config.temperature,
    )
    return texts


def sample_and_keep(
    config: RSFTConfig, checkpoint: str | Path, keys: Sequence[CaseKey] | None = None
) -> list[dict]:
    """Sample, score and select (module docstring, steps 2-4): every sample as a dict with its prompt
    (``prompt_index``, ``task_id``, ``seed``, ``force_decay`` and, on a case set, ``case_id``),
    ``sample`` index, ``completion``, ``scaled_reward``, ``terminal_reward``, ``broken_rules``,
    ``error``, ``strategy``, ``slerp_scaled_reward``, ``kept`` and ``dropped``.

    ``keys``: the prompts' cases, for a caller that mixes dynamics (the learning experiment's cells);
    by default :func:`prompt_keys`."""

    keys, case_ids = prompt_keys(config) if keys is None else (list(keys), [None] * len(keys))
    observations = [reset_observation(key.seed, key.task_id, key.force_decay) for key in keys]
    texts = sample_completions(config, checkpoint, observations)
    k = config.samples_per_prompt
    if len(texts) != k * len(keys):
        raise RuntimeError(f"expected {k * len(keys)} samples, got {len(texts)}")
    rollouts = score_texts(texts, [key for key in keys for _ in range(k)])
    slerp = [r["scaled_reward"] for r in score_plans([UNIFORM_SLERP_PLAN] * len(keys), keys)]
    samples = [
        {
            "prompt_index": i // k,
            "task_id": keys[i // k].task_id,
            "seed": keys[i // k].seed,
            "force_decay": bool(keys[i // k].force_decay),
            **({} if case_ids[i // k] is None else {"case_id": case_ids[i // k]}),
            "sample": i % k,
            "completion": text,
            "scaled_reward": float(r.scaled_reward),
            "terminal_reward": float(r.terminal_reward),
            "broken_rules": list(r.broken_rules),
            "error": r.error,
            "strategy": r.strategy,
            "slerp_scaled_reward": float(slerp[i // k]),
        }
        for i, (text, r) in enumerate(zip(texts, rollouts))
    ]
    return select(samples, KeepRule.of(config))


def write_samples(samples: Sequence[dict], out: Path) -> None:
    """Every sample, kept or why dropped, one JSON line each, in ``out/rsft_samples.jsonl``."""
    with (out / RSFT_SAMPLES_FILE).open("w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)


def training_rows(samples: Sequence[dict], force_decay: bool, prompt_format: str = "full") -> list[dict]:
    """The kept samples as SFT rows (the policy's prompt in its ``prompt_format``, the sampled
    completion as it was written), each on its sample's case (its ``force_decay`` where it records
    one, else ``force_decay``) and with its ``case_id`` where it has one."""
    rows = []
    for s in samples:
        if not s["kept"]:
            continue
        obs = reset_observation(s["seed"], s["task_id"], s.get("force_decay", force_decay))
        rows.append({"prompt": build_messages(obs, prompt_format),
                     "completion": [{"role": "assistant", "content": s["completion"]}],
                     "seed": s["seed"], "task_id": s["task_id"],
                     **({"case_id": s["case_id"]} if "case_id" in s else {})})  # fmt: skip
    return rows


def run_rsft(config: RSFTConfig) -> dict:
    """Steps 1-5 of the module docstring except the gate, on local folders; returns the SFT summary
    with ``rsft`` (the counts) and ``sample_seconds``. Raises :class:`orthojob.lifecycle.gate_file.GateError` when
    the pre-flight refuses, :class:`RSFTError` when nothing is kept."""
    if not config.from_checkpoint:
        raise ConfigError("orthojob rsft needs --from-checkpoint (the gated checkpoint to sample from)")
    if not config.skip_gate_check:
        content = gate_file.check_gate(config.from_checkpoint)
        log.info("RSFT starts from %s (gate %s passed)", config.from_checkpoint, content.get("stage"))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    samples = sample_and_keep(config, config.from_checkpoint)
    sample_seconds = time.perf_counter() - t0
    write_samples(samples, out)
    tally = counts(samples)
    log.info("RSFT samples: %s", tally)

    rows = training_rows(samples, config.force_decay, prompt_format_of(config.from_checkpoint))
    if not rows:
        raise RSFTError(
            ExitCode.USAGE,
            f"no sampled completion met the keep rule ({tally['samples']} samples on {tally['prompts']} prompts: "
            f"{tally['not_a_plan']} not a plan, {tally['hard_rule']} break a hard rule, {tally['below_threshold']} "
            f"at or below --keep-min-reward {config.keep_min_reward}, {tally['below_slerp']} below uniform SLERP "
            "+ --keep-min-margin-over-slerp). Lower the threshold, raise --samples-per-prompt or --temperature, "
            "or start from a better checkpoint.",
        )
    info = {"source": "rsft", **tally}
    if config.cases is not None:  # the set's training side, as the prompts took it
        loaded = case_sets.load_case_set(config.cases, config.heldout_share, config.force_decay)
        loaded.log_input("train")
        info |= {"cases": loaded.source, "split_digest": loaded.split.digest}
    summary = run_sft(config, rows, info)
    summary["rsft"] = tally
    summary["sample_seconds"] = sample_seconds
    return summary


def log_rsft(summary: dict, out: str | Path) -> None:
    """Into the active MLflow stage run (if any): ``rsft/*`` counts, the samples file and a table of
    the kept samples."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return

    tracking.log_metrics({f"rsft/{k}": v for k, v in summary["rsft"].items()})
    samples_file = Path(out) / RSFT_SAMPLES_FILE
    if samples_file.is_file():
        mlflow.log_artifact(str(samples_file))
        kept = [json.loads(line) for line in samples_file.read_text().splitlines() if line]
        kept = [s for s in kept if s["kept"]][:256]
        if kept:
            mlflow.log_table(
                {k: [s[k] if k != "completion" else s[k][:2000] for s in kept]
                 for k in ("task_id", "seed", "sample", "completion", "scaled_reward", "slerp_scaled_reward")},
                artifact_file="rsft_kept.json",
            )  # fmt: skip


def run_rsft_cli(args: argparse.Namespace) -> int:
    """``orthojob rsft``: 0 when its gate passed, 12 when it failed, 10-13 when the starting checkpoint's
    gate refuses, 2 on a bad configuration or when nothing is kept."""
    try:
        config = config_from_args(args, "rsft")
        stage, settings = gate_settings_for(args, "rsft")
        if not config.from_checkpoint:
            raise ConfigError("orthojob rsft needs --from-checkpoint (the gated checkpoint to sample from)")
    except (TypeError, ValueError) as exc:
        print(f"orthojob rsft: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if config.cases is not None:  # before any model loads: a bad case set fails at once, every problem named
        refused = case_sets.check_case_set(config.cases, config.heldout_share, config.force_decay, "rsft")
        if refused is not None:
            return refused
    destination = config.out
    config = localize(config, lambda m: print(f"[rsft] {m}"))
    try:
        summary = run_rsft(config)
    except gate_file.GateError as exc:
        print(f"orthojob rsft: {exc.message}", file=sys.stderr)
        _tag("orthorl.refused", f"gate exit {exc.exit_code}")
        return exc.exit_code
    except RSFTError as exc:
        print(f"orthojob rsft: {exc.message}", file=sys.stderr)
        _tag("orthorl.refused", "nothing kept")
        return exc.exit_code
    content = gate.run_gate(config.out, stage, settings, config.task_ids, config.force_decay, config)
    print(gate_file.format_gate(content))
    log_stage(summary, content, config.out)
    log_rsft(summary, config.out)
    if destination != config.out:
        storage.publish(config.out, destination)
    print(format_counts(summary))
    print(
        f"[rsft] {summary['steps']} steps in {summary['train_seconds']:.0f} s; loss {summary['first_loss']} -> "
        f"{summary['final_loss']}; gate {stage} {'passed' if content['passed'] else 'FAILED'}; saved to {destination}"
    )
    return 0 if content["passed"] else ExitCode.GATE_FAILED


def format_counts(summary: dict) -> str:
    c = summary["rsft"]
    dropped = ", ".join(f"{c[r]} {r}" for r in DROP_REASONS)
    means = ", ".join(
        f"{k[: -len('_reward_mean')]} {c[k]:.3f}"
        if isinstance(c[k], float)
        else f"{k[: -len('_reward_mean')]} -"
        for k in ("sample_reward_mean", "best_of_k_reward_mean", "kept_reward_mean", "slerp_reward_mean")
    )
    return (
        f"[rsft] kept {c['kept']} of {c['samples']} samples ({c['prompts_kept']} of {c['prompts']} prompts); "
        f"dropped: {dropped}; scaled reward means: {means}; sampling {summary['sample_seconds']:.0f} s"
    )


def _tag(key: str, value: str) -> None:
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.set_tag(key, value)


def add_rsft_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``orthojob rsft``'s flags: :class:`RSFTConfig`'s, ``--preset`` and the gate's."""
    return add_sft_arguments(parser, "rsft", with_gate=True)


__all__ = [
    "DROP_REASONS",
    "KeepRule",
    "RSFTConfig",
    "RSFTError",
    "add_rsft_arguments",
    "counts",
    "format_counts",
    "prompt_cases",
    "prompt_keys",
    "run_rsft",
    "run_rsft_cli",
    "sample_and_keep",
    "select",
    "training_rows",
    "write_samples",
]
