#!/usr/bin/env bash
# The SGLang backend's check on real hardware (see docs/sglang_backend.md, "Verify on hardware").
# Needs a CUDA machine with the pinned SGLang:  pip install -e ".[sglang,dev]"
#
#   scripts/gpu_smoke.sh                                  # min(2, GPUs) ranks, tiny random Qwen3
#   NPROC=8 scripts/gpu_smoke.sh --model-path /models/Qwen3-4B
#
# Runs, on every rank: engine up; publish from an FSDP2 model; generate with logprobs at three
# temperatures and compare with the trainer; a partial rollout across a publish; sleep / wake;
# abort. Each rank prints "[rank i] OK ..." with the measured logprob differences.
# Without SGLang (one GPU, no internet): python scripts/gpu_rehearsal.py --out rehearsal.json
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi -L
python - <<'PY'
import importlib.metadata as md
from minippo.engine.sglang_engine import SGLANG_VERSION
have = md.version("sglang")
assert have == SGLANG_VERSION, f"sglang {have} is installed, the backend is pinned to {SGLANG_VERSION}"
print("sglang", have, "| torch", md.version("torch"))
PY
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF  # the engine refuses expandable_segments
NPROC=${NPROC:-$(python -c 'import torch; print(min(2, torch.cuda.device_count()))')}
python -m torch.distributed.run --nproc-per-node "$NPROC" tests/gpu/sglang_smoke.py "$@"
