"""Where a GRPO step's wall time goes (benchmark, not a test): single process, one core.

Runs real GRPO steps through the project's trainer (:func:`orthojob.stages.grpo_trainer.train`: TRL's
GRPOTrainer as :class:`~orthojob.stages.grpo_trainer.RecordingGRPOTrainer`, the five project rewards) for

* ``learn``: ``make learn``'s GRPO from BC, its config built by
  :func:`experiments.learning.experiment.grpo_job_config` (run ``grpo_bc``) from :class:`experiments.learning.config.LearnConfig`'s
  defaults, on :func:`experiments.learning.experiment.base_model`'s model (``--checkpoint DIR``: a trained one, such as
  ``runs/learn/bc``);
* ``tiny``: ``make run``'s GRPO, the ``tiny-cpu`` preset's ``grpo`` section
  (:data:`orthojob.stages.presets.PRESETS`), on the preset's tiny model built as the pipeline builds it
  (``--checkpoint DIR``: its BC checkpoint, e.g. ``runs/pipeline/bc_sft``),

with only ``steps`` (warm-up + measured) and the output folder changed. The base models are untrained:
they stop at EOS only by chance, so every batch's longest completion runs to the whole budget
(pessimistic for generation and the log-prob passes, optimistic for the rewards, which reject unparsable
plans quickly); the table says which model was used.

Every named part is the time spent in it and not in a part nested inside it (exclusive seconds), so
the parts add up to the step's wall time, measured from the step's ``on_step_begin`` to the end of its
logging (``_maybe_log_save_evaluate``). Collected in this process only, without changing what the step
does: TRL's own profiling contexts (:mod:`trl.extras.profiling`: ``transformers.generate``, each reward
function, ``compute_loss``), and wrappers around TRL's and the trainer's methods:

* generation: seconds in ``transformers.generate``; decode steps (generate's steps: the batch's
  longest completion), generated tokens (to each completion's EOS, included), tokens/s, the share of the
  batch's generated token slots that are padding after EOS, the prompts' left-padding share, the share of
  completions that stopped at EOS, and the sequence slots (completions x (longest prompt + decode
  steps): what each log-prob forward and the backward read);
* log-probabilities (TRL's ``_get_per_token_logps_and_entropies``), told apart by the call: the policy's
  with gradients (the loss's forward), the policy's without (old log-probs for importance sampling:
  none when each batch is generated for one optimizer step), the reference's (TRL's ref model, or the
  policy with its adapter disabled; none with beta 0);
* the rest of ``compute_loss``, ``accelerator.backward``, gradient-norm clipping, the optimizer step;
* each reward function as TRL calls it;
* other = wall - the parts above; of which the trainer's counterfactual strategy scoring, completion
  recording (``completions.jsonl``, table rows, ``env/*`` diagnostics), logging, the TrainerCallbacks,
  and the rest (TRL's glue: tokenising and decoding, advantages, metrics, tensors moved and padded).

Not included: model loading and the reference model's copy (before the first step), the data loader
between steps (printed below the table), ``make learn``'s held-out evaluations (every ``eval_every`` steps
in its callback) and MLflow logging (no MLflow run is open here).

Printed per preset: per measured step and their median, in seconds unless the row names another unit,
and each part's share of the measured steps' total wall time.

    OMP_NUM_THREADS=1 python bench/grpo_step.py [--preset learn|tiny|both] [--steps 4] [--warmup 1]
                                                [--checkpoint DIR] [--out runs/bench/grpo_step] [--json FILE]
                                                [--sampler shared-prefix|generate]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRESETS = ("learn", "tiny")
TOP_PARTS: tuple[tuple[str, str], ...] = (
    ("generation", "generate"),
    ("policy log-probs, loss forward", "policy_logps"),
    ("policy log-probs, no grad (old)", "old_logps"),
    ("reference log-probs", "ref_logps"),
    ("loss, rest of compute_loss", "compute_loss"),
    ("backward", "backward"),
    ("grad-norm clip", "clip_grad"),
    ("optimizer step", "optimizer"),
)
"""(row, section) of the step's named parts before the rewards."""
OTHER_PARTS: tuple[tuple[str, str], ...] = (
    ("counterfactual strategy scoring", "strategy_advantage"),
    ("completion recording", "recording"),
    ("logging", "logging"),
    ("trainer callbacks", "callbacks"),
)
"""(row, section) of the named parts of "other"; the remainder is its ``rest`` row."""
OTHER = "other"
REST = "rest (TRL glue)"
REWARDS = "rewards"
TRL_SECTIONS = {"transformers.generate": "generate", "transformers.generate_batch": "generate"}
"""TRL profiling names -> this benchmark's section (the others keep their name)."""
SKIPPED_TRL_SECTIONS = frozenset({"_get_per_token_logps_and_entropies"})
"""TRL profiling names not kept as sections: the benchmark's own wrapper names the call."""


# ---------------------------------------------------------------------------------------------
# Collecting and adding up
# ---------------------------------------------------------------------------------------------


class Clock:
    """Exclusive seconds per named section, per step.

    A section's time is its wall time less that of the sections opened inside it, so sections never
    count a second twice. Sections outside a step (before the first, between steps) are not kept.
    ``steps``: one dict per finished step: ``wall`` (s), ``sections`` (name -> s), ``generation``
    (one :func:`generation_record` per generate call) and ``before`` (s since the previous step ended).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.steps: list[dict] = []
        self._step: dict | None = None
        self._stack: list[list] = []  # [name, start, seconds of the sections inside]
        self._last_end: float | None = None

    def begin_step(self) -> None:
        start = self.now()
        before = None if self._last_end is None else start - self._last_end
        self._step = {"start": start, "sections": {}, "generation": [], "before": before}

    def end_step(self) -> None:
        if self._step is None:
            return
        self._last_end = self.now()
        step, self._step = self._step, None
        step["wall"] = self._last_end - step.pop("start")
        self.steps.append(step)

    def push(self, name: str) -> None:
        self._stack.append([name, self.now(), 0.0])

    def pop(self) -> None:
        name, start, inside = self._stack.pop()
        total = self.now() - start
        if self._stack:
            self._stack[-1][2] += total
        if self._step is not None:
            sections = self._step["sections"]
            sections[name] = sections.get(name, 0.0) + total - inside

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def add_generation(self, record: dict) -> None:
        if self._step is not None:
            self._step["generation"].append(record)


def breakdown(wall: float, sections: dict[str, float], reward_names: Sequence[str]) -> dict[str, float]:
    """One step's parts (s), in table order: :data:`TOP_PARTS`, ``rewards`` and ``reward:<name>`` per
    reward function, ``other`` and ``other:<row>`` for :data:`OTHER_PARTS` and :data:`REST`.

    The top-level parts (every :data:`TOP_PARTS` row, ``rewards``, ``other``) add up to ``wall``; the
    ``reward:`` rows to ``rewards``; the ``other:`` rows to ``other``, whose :data:`REST` row holds the
    sections no row names and the step's time outside any section."""
    parts = {row: sections.get(name, 0.0) for row, name in TOP_PARTS}
    rewards = {f"reward:{name}": sections.get(name, 0.0) for name in reward_names}
    parts[REWARDS] = sum(rewards.values())
    parts.update(rewards)
    other = {f"{OTHER}:{row}": sections.get(name, 0.0) for row, name in OTHER_PARTS}
    named = sum(parts[row] for row, _ in TOP_PARTS) + parts[REWARDS]
    parts[OTHER] = wall - named
    parts.update(other)
    parts[f"{OTHER}:{REST}"] = parts[OTHER] - sum(other.values())
    return parts


def generation_record(
    prompt_lengths: Sequence[int], completion_lengths: Sequence[int], stopped: Sequence[bool]
) -> dict:
    """One generate call's shape: completions (B), decode steps (generate's steps: the longest
    completion, tokens), generated tokens (each completion to its EOS), completions that stopped at EOS,
    token slots (B x steps) and the prompts' tokens and padded slots (B x the longest prompt)."""
    steps = max(completion_lengths, default=0)
    return {
        "completions": len(completion_lengths),
        "decode_steps": steps,
        "tokens": int(sum(completion_lengths)),
        "stopped": int(sum(bool(s) for s in stopped)),
        "slots": steps * len(completion_lengths),
        "prompt_tokens": int(sum(prompt_lengths)),
        "prompt_slots": max(prompt_lengths, default=0) * len(prompt_lengths),
    }


def generation_stats(records: Sequence[dict], seconds: float) -> dict[str, float]:
    """A step's generation figures from its :func:`generation_record` s and its generation seconds:
    decode steps, generated tokens, tokens/s, EOS padding share (of the generated slots), prompt
    left-padding share (of the prompts' slots), share of completions that stopped at EOS, and the
    sequence slots (B x (longest prompt + decode steps): the tokens each log-prob forward reads)."""
    keys = ("decode_steps", "tokens", "slots", "stopped", "completions", "prompt_tokens", "prompt_slots")
    total = {k: sum(r[k] for r in records) for k in keys}
    return {
        "decode steps": total["decode_steps"],
        "generated tokens": total["tokens"],
        "tokens/s": total["tokens"] / seconds if seconds > 0 else float("nan"),
        "EOS padding share": 1 - total["tokens"] / total["slots"] if total["slots"] else float("nan"),
        "prompt padding share": 1 - total["prompt_tokens"] / total["prompt_slots"]
        if total["prompt_slots"]
        else float("nan"),
        "stopped at EOS": total["stopped"] / total["completions"] if total["completions"] else float("nan"),
        "sequence slots": total["prompt_slots"] + total["slots"],
    }


# ---------------------------------------------------------------------------------------------
# Instrumenting the trainer (this process only)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Route TRL's profiling contexts and the step's methods through ``clock`` while inside; every
    wrapper calls the original and returns what it returns."""
    from unittest import mock

    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers.trainer_callback import CallbackHandler
    from trl.extras.profiling import ProfilingContext
    from trl.trainer import grpo_trainer as trl_grpo

    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer as Trainer

    in_reference = [0]  # > 0 inside TRL's use_adapter: the PEFT policy serving as the reference

    def timed(name: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with clock.section(name):
                return original(*args, **kwargs)

        return wrapper

    profiling_enter, profiling_exit = ProfilingContext.__enter__, ProfilingContext.__exit__

    def enter(self):
        name = self.name.split(".", 1)[-1]  # "<TrainerClass>.<name>"
        self._bench_kept = name not in SKIPPED_TRL_SECTIONS
        if self._bench_kept:
            clock.push(TRL_SECTIONS.get(name, name))
        return profiling_enter(self)

    def exit_(self, *exc):
        try:
            return profiling_exit(self, *exc)
        finally:
            if getattr(self, "_bench_kept", False):
                clock.pop()

    logps = Trainer._get_per_token_logps_and_entropies

    def per_token_logps(self, model, *args, **kwargs):
        if (self.ref_model is not None and model is self.ref_model) or in_reference[0]:
            name = "ref_logps"
        else:
            name = "policy_logps" if torch.is_grad_enabled() else "old_logps"
        with clock.section(name):
            return logps(self, model, *args, **kwargs)

    use_adapter = trl_grpo.use_adapter

    @contextlib.contextmanager
    def reference_adapter(*args, **kwargs):
        in_reference[0] += 1
        try:
            with use_adapter(*args, **kwargs) as value:
                yield value
        finally:
            in_reference[0] -= 1

    single_turn = Trainer._generate_single_turn

    def generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = single_turn(self, prompt_ids, *args, **kwargs)
        eos = set(self.eos_token_ids)
        clock.add_generation(
            generation_record(
                [len(p) for p in prompt_ids],
                [len(c) for c in completion_ids],
                [bool(c) and c[-1] in eos for c in completion_ids],
            )
        )
        return completion_ids, logprobs

    maybe_log = Trainer._maybe_log_save_evaluate

    def log_save_evaluate(self, *args, **kwargs):
        try:
            with clock.section("logging"):
                return maybe_log(self, *args, **kwargs)
        finally:
            clock.end_step()

    step_begin = CallbackHandler.on_step_begin

    def on_step_begin(self, *args, **kwargs):
        clock.begin_step()
        return step_begin(self, *args, **kwargs)

    patches = [
        (ProfilingContext, "__enter__", enter),
        (ProfilingContext, "__exit__", exit_),
        (Trainer, "_get_per_token_logps_and_entropies", per_token_logps),
        (trl_grpo, "use_adapter", reference_adapter),
        (Trainer, "_generate_single_turn", generate_single_turn),
        (
            Trainer,
            "_strategy_token_advantages",
            timed("strategy_advantage", Trainer._strategy_token_advantages),
        ),
        (Trainer, "_record", timed("recording", Trainer._record)),
        (Trainer, "_log_group_std", timed("recording", Trainer._log_group_std)),
        (Trainer, "_maybe_log_save_evaluate", log_save_evaluate),
        (Trainer, "_clip_grad_norm", timed("clip_grad", Trainer._clip_grad_norm)),
        (Accelerator, "backward", timed("backward", Accelerator.backward)),
        (AcceleratedOptimizer, "step", timed("optimizer", AcceleratedOptimizer.step)),
        (CallbackHandler, "call_event", timed("callbacks", CallbackHandler.call_event)),
        (CallbackHandler, "on_step_begin", on_step_begin),
    ]
    with contextlib.ExitStack() as stack:
        for target, attribute, new in patches:
            stack.enter_context(mock.patch.object(target, attribute, new))
        yield


# ---------------------------------------------------------------------------------------------
# The two presets' GRPO configs
# ---------------------------------------------------------------------------------------------


def learn_job(work: Path, checkpoint: str | None, steps: int):
    """``make learn``'s GRPO from BC (:func:`experiments.learning.experiment.grpo_job_config`, run ``grpo_bc``) and
    a line describing it."""
    from experiments.learning.config import LearnConfig
    from experiments.learning.experiment import base_model, grpo_job_config

    cfg = LearnConfig(out=str(work / "learn"))
    start = Path(checkpoint) if checkpoint else base_model(cfg)
    job = dataclasses.replace(grpo_job_config(cfg, start, "grpo_bc"), steps=steps)
    what = (
        f"checkpoint {checkpoint}" if checkpoint else "the untrained base model (make learn starts from BC)"
    )
    return job, f"make learn's GRPO from BC (experiments.learning.experiment.grpo_job_config), from {what}"


def tiny_job(work: Path, checkpoint: str | None, steps: int):
    """The ``tiny-cpu`` preset's GRPO (``make run``), on the preset's tiny model built as the pipeline
    builds it for its default stages, and a line describing it."""
    from orthojob.modeling import models
    from orthojob.stages.presets import PRESETS as STAGE_PRESETS

    preset = STAGE_PRESETS["tiny-cpu"]
    folder = work / "tiny" / "tiny-model"
    if not (folder / "config.json").is_file():
        tasks = sorted({preset.task_id, *preset.bc_sft.task_ids})
        models.build_tiny(folder, tasks, preset.force_decay, **preset.tiny_arch)
    job = dataclasses.replace(
        preset.grpo,
        model=str(folder),
        from_checkpoint=checkpoint,
        out=str(work / "tiny" / "grpo"),
        steps=steps,
    )
    what = f"checkpoint {checkpoint}" if checkpoint else "the untrained tiny model (make run starts from BC)"
    return job, f"make run's GRPO (preset tiny-cpu, its grpo section), from {what}"


def run_preset(
    name: str, work: Path, checkpoint: str | None, warmup: int, steps: int, sampler: str | None = None
) -> dict:
    """``warmup`` + ``steps`` GRPO steps of preset ``name``: its settings and each measured step's
    parts (:func:`breakdown`) and generation figures (:func:`generation_stats`)."""
    from orthojob.modeling import models
    from orthojob.stages import grpo_trainer
    from orthojob.stages.grpo_config import validate

    build = learn_job if name == "learn" else tiny_job
    job, description = build(work, checkpoint, warmup + steps)
    if sampler:
        job = dataclasses.replace(job, sampler=sampler)
    description += f"; sampler {job.sampler}"
    validate(job)
    models.device_info()
    clock = Clock()
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    # the trainer's printed logs go to a file (printing them is still inside the step)
    with (
        (out / "train_stdout.log").open("w") as log_file,
        contextlib.redirect_stdout(log_file),
        instrumented(clock),
    ):
        result = grpo_trainer.train(job)
    trainer = result.trainer
    names = list(trainer.reward_func_names)
    measured = clock.steps[warmup:]
    rows = []
    for step in measured:
        parts = breakdown(step["wall"], step["sections"], names)
        stats = generation_stats(step["generation"], parts["generation"])
        rows.append({"wall": step["wall"], **parts, **stats, "sections": step["sections"]})
    config = trainer.model.config
    return {
        "preset": name,
        "description": description,
        "settings": {
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "completions per step": job.batch_size * job.grad_accum,
            "num_generations": job.num_generations,
            "max_completion_length": job.max_completion_length,
            "temperature": job.temperature,
            "beta": job.beta,
            "reference model": trainer.ref_model is not None,
            "lora_r": job.lora_r,
            "loss_type": job.loss_type,
            "strategy_advantage": job.strategy_advantage,
            "objective": job.objective,
            "gradient_checkpointing": job.gradient_checkpointing,
        },
        "reward_names": names,
        "warmup": warmup,
        "steps": rows,
        "between_steps": [s["before"] for s in measured if s["before"] is not None],
    }


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

GENERATION_ROWS: tuple[tuple[str, str], ...] = (
    ("decode steps", "{:.0f}"),
    ("generated tokens", "{:.0f}"),
    ("tokens/s", "{:.0f}"),
    ("EOS padding share", "{:.2f}"),
    ("prompt padding share", "{:.2f}"),
    ("stopped at EOS", "{:.2f}"),
    ("sequence slots", "{:.0f}"),
)
"""(row, format) of the generation figures (:func:`generation_stats`)."""


def table_rows(result: dict) -> list[tuple[str, str, list[float], bool]]:
    """(label, number format, per-step values, has a share of the wall time) in print order."""
    steps = result["steps"]

    def values(key: str) -> list[float]:
        return [s[key] for s in steps]

    rows = [("step wall (s)", "{:.3f}", values("wall"), True)]
    for row, _ in TOP_PARTS:
        rows.append((row, "{:.3f}", values(row), True))
        if row == "generation":
            rows += [(f"  {label}", fmt, values(label), False) for label, fmt in GENERATION_ROWS]
    rows.append((f"{REWARDS} ({len(result['reward_names'])} functions)", "{:.3f}", values(REWARDS), True))
    rows += [(f"  {n}", "{:.3f}", values(f"reward:{n}"), True) for n in result["reward_names"]]
    rows.append((f"{OTHER} (wall - the parts above)", "{:.3f}", values(OTHER), True))
    rows += [(f"  {row}", "{:.3f}", values(f"{OTHER}:{row}"), True) for row, _ in (*OTHER_PARTS, (REST, ""))]
    return rows


def format_table(result: dict) -> str:
    """The preset's settings and its per-step table: each measured step, the median, and the share of
    the measured steps' total wall time."""
    steps = result["steps"]
    first = result["warmup"] + 1
    total_wall = sum(s["wall"] for s in steps)
    head = f"{'':<40}" + "".join(f"{'step ' + str(first + k):>10}" for k in range(len(steps)))
    head += f"{'median':>10}{'share':>8}"
    lines = [f"== {result['preset']}: {result['description']}"]
    lines.append("   " + ", ".join(f"{k} {v}" for k, v in result["settings"].items()))
    lines.append(
        f"   {len(steps)} measured steps after {result['warmup']} warm-up, one thread; seconds unless named"
    )
    lines.append(head)
    for label, fmt, vals, has_share in table_rows(result):
        cells = "".join(f"{fmt.format(v):>10}" for v in vals)
        median = fmt.format(statistics.median(vals)) if vals else "-"
        share = f"{sum(vals) / total_wall:>8.1%}" if has_share and total_wall > 0 else f"{'':>8}"
        lines.append(f"{label:<40}{cells}{median:>10}{share}")
    gaps = result["between_steps"]
    if gaps:
        lines.append(
            f"   between steps (data loader, outside the steps): median {statistics.median(gaps):.4f} s"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("learn", "tiny", "both"), default="both")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before them, not measured (default 1)")
    parser.add_argument("--checkpoint", help="start from this checkpoint (one preset only)")
    parser.add_argument("--out", default="runs/bench/grpo_step", help="base models and GRPO outputs")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--sampler",
        choices=("shared-prefix", "generate"),
        help="GRPOJobConfig.sampler (default: the config's, shared-prefix)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.checkpoint and args.preset == "both":
        parser.error("--checkpoint belongs to one preset: add --preset learn or --preset tiny")

    import torch

    torch.set_num_threads(1)
    presets = PRESETS if args.preset == "both" else (args.preset,)
    results = []
    for name in presets:
        t0 = time.perf_counter()
        result = run_preset(name, Path(args.out), args.checkpoint, args.warmup, args.steps, args.sampler)
        result["run_seconds"] = time.perf_counter() - t0
        results.append(result)
        print(
            format_table(result)
            + f"\n   whole run (model load, steps, save): {result['run_seconds']:.0f} s\n",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
