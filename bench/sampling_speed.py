"""Sampling a GRPO step's completions: transformers' ``generate`` (as TRL calls it) against the
shared-prefix sampler (:func:`orthojob.modeling.sampling.sample_completions`), interleaved on one core.

For ``make learn``'s GRPO from BC (:func:`experiments.learning.experiment.grpo_job_config`, run ``grpo_bc``:
``prompts_per_step`` training prompts x ``num_generations`` completions, its completion budget and
temperature) and ``make run``'s (the ``tiny-cpu`` preset's grpo section), each round samples one step's
batch with both samplers, the order alternating from round to round, on the same prompts (a new set of
training prompts each round). Printed per round: seconds, decode steps (the longest completion),
completion tokens and tokens/s of each; then the median seconds and the ratio of the medians
(generate / shared-prefix), the completion tokens a second over all rounds and their ratio (the two
samplers draw different completions from the same distribution, so their lengths differ), and whether
greedy completions of the round's prompts are identical.

The models: ``--checkpoint DIR`` (a trained one, e.g. ``runs/learn/bc``; recommended: an untrained
model stops at EOS only by chance, so every completion runs to the budget), else the untrained base.

    OMP_NUM_THREADS=1 python bench/sampling_speed.py [--preset learn|tiny] [--checkpoint DIR]
                                                     [--rounds 5] [--out runs/bench/sampling]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _job(preset: str, work: Path, checkpoint: str | None):
    """The GRPO job config of ``preset`` and the model folder it samples from."""
    if preset == "learn":
        from experiments.learning.config import LearnConfig
        from experiments.learning.experiment import base_model, grpo_job_config

        cfg = LearnConfig(out=str(work / "learn"))
        start = Path(checkpoint) if checkpoint else base_model(cfg)
        return grpo_job_config(cfg, start, "grpo_bc"), start
    from orthojob.modeling import models
    from orthojob.stages.presets import PRESETS

    tiny = PRESETS["tiny-cpu"]
    folder = Path(checkpoint) if checkpoint else work / "tiny" / "tiny-model"
    if not checkpoint and not (folder / "config.json").is_file():
        models.build_tiny(
            folder, sorted({tiny.task_id, *tiny.bc_sft.task_ids}), tiny.force_decay, **tiny.tiny_arch
        )
    return dataclasses.replace(tiny.grpo, model=str(folder)), folder


def _prompt_ids(job, tokenizer, prompt_format: str, first_seed: int, prompts: int) -> list[list[int]]:
    from orthojob.core.prompts import mixed_prompt_rows, prompt_rows

    if job.mixed_cells:
        rows = mixed_prompt_rows(prompts, first_seed, prompt_format, job.level_weights)
    else:
        rows = prompt_rows(prompts, first_seed, job.task_id, job.force_decay, prompt_format)
    ids = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def generate_like_trl(model, prompt_ids, eos, max_new_tokens, pad_token_id, **settings) -> list[list[int]]:
    """TRL's regular generation path: a left-padded batch through ``generate`` with ``settings``
    (``transformers.GenerationConfig`` fields), each row cut after its first EOS token."""
    import torch
    from transformers import GenerationConfig

    width = max(map(len, prompt_ids))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=eos,
        disable_compile=True,
        **settings,
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completions = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        completions.append(row[: ends[0] + 1] if ends else row)
    return completions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("learn", "tiny"), default="learn")
    parser.add_argument("--checkpoint", help="a trained checkpoint of the preset's model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/bench/sampling", help="where an untrained base model is built")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthojob.core.prompts import prompt_format_of
    from orthojob.modeling.sampling import sample_completions

    torch.set_num_threads(1)
    job, folder = _job(args.preset, Path(args.out), args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt_format = prompt_format_of(str(folder))
    eos = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None})
    prompts = job.batch_size // job.num_generations
    budget = job.max_completion_length
    print(
        f"{args.preset}: {folder} ({'checkpoint' if args.checkpoint else 'untrained'}), "
        f"{sum(p.numel() for p in model.parameters()):,} params; a step's batch: {prompts} prompts x "
        f"{job.num_generations} completions, budget {budget} tokens, temperature {job.temperature}; one core"
    )

    def shared(prompt_ids, do_sample=True):
        return sample_completions(
            model, prompt_ids, max_new_tokens=budget, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id,
            do_sample=do_sample, temperature=job.temperature,
        )  # fmt: skip

    def plain(prompt_ids, do_sample=True):
        return generate_like_trl(
            model, prompt_ids, eos, budget, tokenizer.pad_token_id,
            do_sample=do_sample, temperature=job.temperature, top_p=1.0, top_k=0,
        )  # fmt: skip

    samplers = {"generate": plain, "shared-prefix": shared}
    seconds: dict[str, list[float]] = {name: [] for name in samplers}
    tokens_made: dict[str, int] = dict.fromkeys(samplers, 0)
    greedy_same = []
    print(f"{'round':>5} {'sampler':>14} {'seconds':>8} {'decode steps':>12} {'tokens':>7} {'tokens/s':>8}")
    for r in range(args.rounds):
        distinct = _prompt_ids(job, tokenizer, prompt_format, job.prompt_seed_start + r * prompts, prompts)
        batch = [p for p in distinct for _ in range(job.num_generations)]
        order = list(samplers) if r % 2 == 0 else list(reversed(samplers))
        for name in order:
            torch.manual_seed(r)
            t0 = time.perf_counter()
            completions = samplers[name](batch)
            dt = time.perf_counter() - t0
            seconds[name].append(dt)
            tokens = sum(map(len, completions))
            tokens_made[name] += tokens
            longest = max(map(len, completions))
            print(f"{r:>5} {name:>14} {dt:>8.2f} {longest:>12} {tokens:>7} {tokens / dt:>8.0f}", flush=True)
        greedy_same.append(plain(distinct, do_sample=False) == shared(distinct, do_sample=False))
    med = {name: statistics.median(v) for name, v in seconds.items()}
    rate = {name: tokens_made[name] / sum(seconds[name]) for name in samplers}
    print(
        f"median seconds: generate {med['generate']:.2f}, shared-prefix {med['shared-prefix']:.2f}; "
        f"ratio {med['generate'] / med['shared-prefix']:.2f}x; tokens/s over all rounds: generate "
        f"{rate['generate']:.0f}, shared-prefix {rate['shared-prefix']:.0f} "
        f"({rate['shared-prefix'] / rate['generate']:.2f}x); "
        f"greedy completions identical in {sum(greedy_same)}/{len(greedy_same)} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
