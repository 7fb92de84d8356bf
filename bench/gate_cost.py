"""What a quality gate costs on CPU: the tiny-cpu preset's model (built here, offline) gated on one run's
window at the preset's size, single process.

``OMP_NUM_THREADS=1 python bench/gate_cost.py [--seeds-per-cell 16] [--max-new-tokens 256]`` prints the
cases judged, the hard-rule rate a verdict with no break rules out, and the seconds spent generating
and in the whole gate (generation, scoring, the two baselines), wall and CPU. The model is untrained, so nearly every
completion runs to the token cap: the figure is the gate's worst case at that budget.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from orthojob.lifecycle.gate_file import BC_SFT
from orthojob.modeling.models import build_tiny
from orthojob.stages import gate
from orthojob.stages.presets import PRESETS


def main() -> None:
    tiny = PRESETS["tiny-cpu"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds-per-cell", type=int, default=tiny.bc_sft_gate.n_seeds)
    parser.add_argument("--max-new-tokens", type=int, default=tiny.bc_sft_gate.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=tiny.bc_sft_gate.batch_size)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny(Path(tmp) / "tiny", ["task_easy"], tiny.force_decay, **tiny.tiny_arch)
        t0, c0 = time.perf_counter(), time.process_time()
        report = gate.gate_report(str(path), n_seeds=args.seeds_per_cell, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.batch_size, stage=BC_SFT)  # fmt: skip
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    m, g = report["metrics"], report["guarantee"]
    print(f"cases {m['n']} ({args.seeds_per_cell} per cell x {len(report['window']['cells'])} cells), "
          f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}")  # fmt: skip
    print(f"no break rules out a hard-rule rate above {100 * g['rate_ruled_out_with_no_break']:.2f} % (95 %)")
    print(f"mean completion tokens {m['mean_completion_tokens']:.0f}, truncated {m['truncated_rate']:.2f}")
    print(f"generate {m['generate_seconds']:.1f} s; whole gate {seconds:.1f} s wall ({seconds / m['n']:.2f} s a case), "
          f"{cpu:.1f} s CPU (wall on a shared machine includes waiting for a core)")  # fmt: skip


if __name__ == "__main__":
    main()
