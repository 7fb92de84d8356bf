"""GRPO step benchmark on a GPU (not a test): Qwen2.5-3B's architecture, random weights, bf16.

No model can be downloaded here, so the model is a ``Qwen2Config`` with Qwen2.5-3B-Instruct's sizes
(3.09 B parameters: hidden 2048, 36 layers, 16 query / 2 KV heads, MLP 11008, vocabulary 151,936,
tied embeddings, rope theta 1e6) and random initialisation. The tokenizer is the offline tiny one
(:mod:`orthojob.modeling.tiny_model`, trained on the real prompts) padded with unused entries to the full
vocabulary, so every sampled id decodes. A random model never emits EOS: every completion runs to
``--max-completion-length``, which makes the generation workload fixed and comparable.

Each configuration runs in its own process: a few GRPO steps of the project's training setup
(``orthojob.stages.grpo_config.build_grpo_args`` for the ``qwen2.5-3b`` preset: LoRA r 16, bf16, gradient
checkpointing; the real prompts; the five project rewards; the job's trainer, built by
``orthojob.stages.grpo_trainer.RecordingGRPOTrainer.from_config``, which records every completion as a
run does), once with transformers' ``generate`` (TRL's eager path), once with the project's
shared-prefix sampler (:mod:`orthojob.modeling.sampling`, the trainer's default without vLLM) and once
with vLLM colocated (skipped, with the reason, when vLLM does not import). Printed per run:

* step time (s): mean of the steps after the first (the first includes warm-up), and the first;
* generation tokens/s: completion tokens / time in TRL's ``_generate_single_turn`` (with vLLM this
  includes pushing the updated weights to vLLM);
* peak memory (GiB): ``torch.cuda.max_memory_allocated`` (vLLM's colocated KV cache included), and
  the device's used memory at the end;
* MFU: an estimate of the model-FLOPs utilisation (:func:`mfu`).

``--batch-sizes`` repeats the runs for several completions a step; ``--deadline`` skips the runs that
would start with under a minute of it left (printed as skipped).

Without a GPU it says so and exits 0.

    python bench/grpo_gpu.py [--steps 4] [--batch-size 8 | --batch-sizes 8,32,64] [--num-generations 8]
                             [--max-completion-length 256] [--vllm auto|on|off] [--lora-r 16]
                             [--deadline SECONDS]

``--cpu-smoke`` runs the same code path with a tiny model on CPU (checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QWEN25_3B: dict = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
"""Qwen2.5-3B-Instruct's architecture (its config.json, minus the weights)."""
TINY: dict = QWEN25_3B | {
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
RESULT_TAG = "BENCH_RESULT "


def build_tokenizer(work: Path, vocab_size: int) -> Path:
    """The tiny tokenizer (trained on real prompts) padded with unused entries to ``vocab_size``."""
    from orthojob.core.prompts import prompt_rows
    from orthojob.modeling.tiny_model import build_tiny_model

    rows = prompt_rows(4, 0, "task_medium", False) + prompt_rows(2, 0, "task_hard", True)
    corpus = [m["content"] for r in rows for m in r["prompt"]]
    src = build_tiny_model(
        work / "tokenizer-src", vocab_size=1024, max_position_embeddings=32768, corpus=corpus
    )
    out = work / "model"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    next_id, k = 0, 0
    while len(used) < vocab_size:
        while next_id in used:
            next_id += 1
        name = f"_unused_{k}_"
        k += 1
        if name in vocab:
            continue
        vocab[name] = next_id
        used.add(next_id)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    shutil.rmtree(work / "tokenizer-src")
    return out


def build_model(work: Path, sizes: dict, cuda: bool) -> Path:
    """Random Qwen2 model with ``sizes`` saved (bf16 on a GPU) to work/model, with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = build_tokenizer(work, sizes["vocab_size"])
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == sizes["vocab_size"], (len(tok), sizes["vocab_size"])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(**sizes, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"[bench] random Qwen2 model: {n / 1e9:.3f} B parameters ({dtype}), saved to {out}", flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_one(args: argparse.Namespace) -> dict:
    """One benchmark configuration (in its own process); returns the measurements."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from orthojob.core.prompts import prompt_rows
    from orthojob.modeling.adapters import lora_config
    from orthojob.stages.grpo import config_from_args
    from orthojob.stages.grpo_config import build_grpo_args

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    use_vllm = args.run_one == "vllm"
    sampler = "shared-prefix" if args.run_one == "shared-prefix" else "generate"
    model_dir = Path(args.work) / "model"
    config = config_from_args(
        {
            "preset": "qwen2.5-3b",
            "model": str(model_dir),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length,
            "lora_r": args.lora_r,
            "out": str(Path(args.work) / f"out-{args.run_one}"),
            "save_steps": 0,
            "use_vllm": use_vllm,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
            "sampler": sampler,
        }
    )
    devices = {"cuda": cuda, "bf16": bool(cuda and torch.cuda.is_bf16_supported())}
    grpo_args, funcs = build_grpo_args(config, devices, 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = prompt_rows(args.steps * args.batch_size // args.num_generations + 1, 0, "task_medium", False)
    prompt_tokens = max(
        len(
            tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))["input_ids"]
        )
        for r in rows
    )
    if use_vllm:
        grpo_args.vllm_max_model_length = prompt_tokens + args.max_completion_length + 64
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    peft_config = lora_config(args.lora_r) if args.lora_r else None

    from orthojob.stages.grpo_trainer import RecordingGRPOTrainer

    gen = {"seconds": 0.0, "tokens": 0, "calls": 0}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class TimedGRPOTrainer(RecordingGRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            sync()
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            sync()
            if self.state.global_step >= 1:  # the first step's generation includes warm-up
                gen["seconds"] += time.perf_counter() - t0
                gen["tokens"] += sum(len(c) for c in completion_ids)
                gen["calls"] += 1
            return completion_ids, logprobs

    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync()
            step_times.append(time.perf_counter() - self.t0)

    trainer = TimedGRPOTrainer.from_config(
        config,
        model=model,
        reward_funcs=funcs,
        args=grpo_args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[StepTimer()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    later = step_times[1:] or step_times
    result = {
        "run": args.run_one,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": len(step_times),
        "completions_per_step": args.batch_size,
        "prompt_tokens": prompt_tokens,
        "max_completion_length": args.max_completion_length,
        "lora_r": args.lora_r,
        "bf16": devices["bf16"],
        "first_step_s": step_times[0] if step_times else None,
        "step_s": sum(later) / len(later) if later else None,
        "gen_tokens_per_s": gen["tokens"] / gen["seconds"] if gen["seconds"] else None,
        "gen_tokens": gen["tokens"],
        "params": n_params,
    }
    result["mfu"] = mfu(result, torch.cuda.get_device_name() if cuda else "cpu")
    if cuda:
        free, total = torch.cuda.mem_get_info()
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["device_used_gib"] = (total - free) / 2**30
    return result


def _child(args: argparse.Namespace, run: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-one", run, "--work", args.work]
    for flag in ("steps", "batch_size", "num_generations", "max_completion_length", "lora_r",
                 "vllm_gpu_memory_utilization"):  # fmt: skip
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    print(f"[bench] run: {run}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-4000:]
        print(f"[bench] {run} failed (exit {proc.returncode}):\n{tail}", flush=True)
        return {"run": run, "error": f"exit {proc.returncode}"}
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result["wall_s"] = time.perf_counter() - t0
    return result


PEAK_BF16_FLOPS: dict[str, float] = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 peak of a device (FLOP/s) by a part of its name: NVIDIA's data sheets (SXM parts)."""


def mfu(result: dict, device: str) -> float | None:
    """Model-FLOPs utilisation of a step, an estimate: 2 N FLOPs a generated token, and 8 N a token of
    every sequence for training (the loss's forward 2 N, the reference's forward 2 N, the backward 4 N;
    checkpointing's recompute and attention not counted), over the step time and the device's bf16
    peak. ``None`` on a device not in :data:`PEAK_BF16_FLOPS` or without timings."""
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device), None)
    calls = max(result["steps"] - 1, 1)
    if peak is None or not result.get("step_s"):
        return None
    n = result["params"]
    gen_per_step = result["gen_tokens"] / calls
    mean_completion = gen_per_step / result["completions_per_step"]
    seq_tokens = result["completions_per_step"] * (result["prompt_tokens"] + mean_completion)
    return (2 * n * gen_per_step + 8 * n * seq_tokens) / (result["step_s"] * peak)


def _fmt(x, spec: str) -> str:
    return format("n/a", ">" + spec.split(".")[0]) if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per step")
    parser.add_argument("--batch-sizes", help="several completions-per-step, comma-separated (e.g. 8,32,64)")
    parser.add_argument(
        "--deadline", type=int, default=0, help="seconds for all runs; later runs are skipped"
    )
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--lora-r", type=int, default=16, help="0 = full fine-tuning")
    parser.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                        help="auto: run the vLLM configuration when vLLM imports")  # fmt: skip
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--work", help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: check the script only")
    parser.add_argument(
        "--run-one", choices=("transformers", "shared-prefix", "vllm"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)

    if args.run_one:
        print(RESULT_TAG + json.dumps(run_one(args)), flush=True)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("bench/grpo_gpu.py: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    sizes_per_step = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else [args.batch_size]
    if any(b % args.num_generations for b in sizes_per_step):
        print(
            f"each batch size ({sizes_per_step}) must be a multiple of --num-generations ({args.num_generations})"
        )
        return 2
    runs = ["transformers", "shared-prefix"]
    vllm_note = None
    if args.vllm != "off" and not args.cpu_smoke:
        try:
            import vllm  # noqa: F401

            runs.append("vllm")
        except ImportError as exc:
            vllm_note = f"vLLM skipped: it does not import ({exc})"
            if args.vllm == "on":
                print(vllm_note)
                return 1
    tmp = None
    if args.work is None:
        tmp = tempfile.mkdtemp(prefix="grpo-bench-")
        args.work = tmp
    try:
        sizes = TINY if args.cpu_smoke else QWEN25_3B
        if cuda and not args.cpu_smoke:
            print(
                f"[bench] {torch.cuda.get_device_name()}, bf16 {torch.cuda.is_bf16_supported()}", flush=True
            )
        build_model(Path(args.work), sizes, cuda and not args.cpu_smoke)
        start, limit, results = time.perf_counter(), args.timeout, []
        for batch in sizes_per_step:
            for run in runs:
                left = args.deadline - (time.perf_counter() - start) if args.deadline else limit
                if left < 60:
                    results.append(
                        {"run": run, "completions_per_step": batch, "error": "skipped: --deadline"}
                    )
                    continue
                args.batch_size, args.timeout = batch, int(min(limit, left))
                results.append({"completions_per_step": batch} | _child(args, run))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"GRPO, {'tiny model on CPU (smoke)' if args.cpu_smoke else 'Qwen2.5-3B architecture, random weights'}: "
          f"{','.join(map(str, sizes_per_step))} completions/step ({args.num_generations} per prompt), "
          f"{args.max_completion_length} completion tokens, LoRA r {args.lora_r or 'none (full)'}")  # fmt: skip
    print(
        f"{'completions':>11} {'generation':<14} {'step s':>8} {'1st step s':>11} {'gen tok/s':>10} "
        f"{'MFU %':>6} {'peak GiB':>9} {'used GiB':>9}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['completions_per_step']:>11} {r['run']:<14} failed: {r['error']}")
            continue
        print(
            f"{r['completions_per_step']:>11} {r['run']:<14} {_fmt(r['step_s'], '8.2f')} "
            f"{_fmt(r['first_step_s'], '11.2f')} {_fmt(r['gen_tokens_per_s'], '10.0f')} "
            f"{_fmt(r['mfu'] * 100 if r.get('mfu') else None, '6.1f')} "
            f"{_fmt(r.get('peak_allocated_gib'), '9.1f')} {_fmt(r.get('device_used_gib'), '9.1f')}"
        )
    if vllm_note:
        print(vllm_note)
    print(json.dumps(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
