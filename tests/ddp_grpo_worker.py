"""One rank of the data-parallel GRPO test (tests/test_grpo.py::test_ddp_two_processes).

Launched as ``torchrun --standalone --nproc_per_node 2 tests/ddp_grpo_worker.py WORKDIR``;
WORKDIR/tiny holds the tiny model, built by the test before the launch (ranks building it
themselves would race on the files). Every rank trains 2 GRPO steps through
:func:`orthojob.stages.grpo.train` (gloo on CPU) and writes WORKDIR/rank<R>.json with the digest of its
trainable weights, so the test can compare the ranks, and the gloo threads still running once
training has returned (there should be none).

A random tiny model writes no JSON, so the five rewards are equal within every group and GRPO's
advantages (hence the updates) would be zero: the worker registers a sixth, test-only reward,
``reward_digest_spread`` (a hash of the text, different for different completions), so the ranks
really update their weights and the all-reduce is what keeps them identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from orthojob.core.parsing import completion_text  # noqa: E402
from orthojob.ops.process_group import process_group_threads  # noqa: E402
from orthojob.rewards import reward_functions  # noqa: E402
from orthojob.stages.grpo import config_from_args, train_and_gate  # noqa: E402
from orthojob.stages.grpo_config import validate  # noqa: E402
from orthojob.stages.grpo_trainer import trainable_digest  # noqa: E402

_five = reward_functions.active_reward_funcs


def reward_digest_spread(completions, **kwargs) -> list[float]:
    """Test-only: a value in [0, 1) that differs between different completion texts."""
    return [int(hashlib.sha256(completion_text(c).encode()).hexdigest()[:8], 16) / 2**32 for c in completions]


def _with_spread(names=None):
    return [*_five(names), reward_digest_spread]


def main(workdir: str) -> int:
    work = Path(workdir)
    rank = int(os.environ["RANK"])
    config = config_from_args(
        {
            "preset": "tiny-cpu",
            "model": str(work / "tiny"),
            "steps": 2,
            "max_completion_length": 32,
            "out": str(work / "out"),
            "gate_seeds": 2,
            "skip_sft_gate": True,
        }
    )
    from transformers import AutoModelForCausalLM

    initial = trainable_digest(AutoModelForCausalLM.from_pretrained(work / "tiny"))  # full FT: all weights
    validate(config)
    result = train_and_gate(config, reward_funcs=_with_spread(config.rewards))
    trainer = result.trainer
    report = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "accelerate_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "global_step": trainer.state.global_step,
        "digest": trainable_digest(trainer.model),
        "initial_digest": initial,
        "reward_names": list(trainer.reward_func_names),
        "gate_passed": result.gate_passed,
        # after train(): the process group must be gone, threads and all, before the interpreter's
        # teardown (where a rank still holding it was seen to abort)
        "process_group_threads": process_group_threads(),
    }
    (work / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
