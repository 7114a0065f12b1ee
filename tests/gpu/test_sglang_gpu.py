"""GPU check of the SGLang backend (marker ``gpu``; excluded by default, run with ``-m gpu``).

Launches ``tests/gpu/sglang_smoke.py`` under torchrun on min(2, visible GPUs) ranks (override with
$MINIPPO_SMOKE_NPROC; $MINIPPO_SMOKE_MODEL selects an HF checkpoint instead of the tiny random
Qwen3). Needs CUDA and ``pip install "minippo[sglang]"``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minippo.engine.sglang_engine import SGLANG_VERSION

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).with_name("sglang_smoke.py")


def test_sglang_backend_on_gpus():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip('needs sglang: pip install "minippo[sglang]"')
    assert importlib.metadata.version("sglang") == SGLANG_VERSION, "install the pinned sglang"
    nproc = int(os.environ.get("MINIPPO_SMOKE_NPROC", min(2, torch.cuda.device_count())))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(SCRIPT)]
    if os.environ.get("MINIPPO_SMOKE_MODEL"):
        cmd += ["--model-path", os.environ["MINIPPO_SMOKE_MODEL"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("] OK ") == nproc
