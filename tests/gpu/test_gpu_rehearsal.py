"""The GPU rehearsal on one CUDA GPU (marker ``gpu``; needs no SGLang, only the pinned wheel file:
see scripts/gpu_rehearsal.py). Writes its figures to $MINIPPO_REHEARSAL_OUT (default
rehearsal.json in the working directory) for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import sglang_pieces

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_rehearsal():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if sglang_pieces.find_wheel() is None:
        pytest.skip("needs the sglang wheel file (pip download --no-deps sglang==0.5.23)")
    out = Path(os.environ.get("MINIPPO_REHEARSAL_OUT", "rehearsal.json")).resolve()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_rehearsal.py"), "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["wall_s"] < 8 * 60
    assert all(r["bit_exact"] for r in report["publish"].values())
