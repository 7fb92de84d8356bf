#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA GPU, in under 10 minutes: the GPU tests, then the
# GRPO step benchmark of the qwen2.5-3b preset at 256 completion tokens and 8 / 32 / 64 completions a
# step, transformers' generate against the shared-prefix sampler (and vLLM where it imports); the runs
# that would not finish inside its deadline are printed as skipped.
# Logs go to $LOGS (default: ./gpu-checks); each part has its own time limit.
#
#     bash bench/gpu_checks.sh
set -u
LOGS=${LOGS:-gpu-checks}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" - <<'PY'
import importlib.metadata as md
print({d: md.version(d) for d in ("torch", "transformers", "trl", "datasets", "peft", "accelerate", "pyarrow")})
PY
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$LOGS/test_gpu.log"
echo "tests/test_gpu.py exit ${PIPESTATUS[0]}"
timeout 450 "$PY" bench/grpo_gpu.py --steps 2 --batch-sizes 8,32,64 --max-completion-length 256 --timeout 150 \
    --deadline 420 2>&1 | tee "$LOGS/grpo_gpu_256.log"
echo "bench 256 exit ${PIPESTATUS[0]}"
