"""The GPU rehearsal on one CUDA GPU (marker ``gpu``; needs no SGLang; the publish check needs the
pinned wheel file, and is skipped without it: see scripts/gpu_rehearsal.py). Writes its report to
$MINIPPO_REHEARSAL_OUT (default rehearsal.json in the working directory) for
docs/benchmarks.md, and checks that it holds the keys of a dry run's report (the CPU suite checks
the dry run's keys and values: tests/unit/test_gpu_rehearsal*.py)."""

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
SCRIPT = ROOT / "scripts" / "gpu_rehearsal.py"


def _key_paths(obj, prefix: str = "") -> set[str]:
    """Every key of a JSON report as a dotted path (list items merged as ``[]``)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else k
            out |= {path} | _key_paths(v, path)
    elif isinstance(obj, list):
        for v in obj:
            out |= _key_paths(v, prefix + "[]")
    return out


def _rehearse(out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_gpu_rehearsal(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    skip = [] if sglang_pieces.find_wheel() else ["--skip", "publish"]
    out = Path(os.environ.get("MINIPPO_REHEARSAL_OUT", "rehearsal.json")).resolve()
    report = _rehearse(out, *skip)
    assert report["ok"] and report["verdict"] == "OK" and report["wall_s"] < 8 * 60
    recipe = report["recipe"]
    assert all(recipe["checks"].values()), recipe["checks"]  # every CUDA check ran and passed
    assert all(run["learned"] for run in report["tiny"]["runs"].values())
    dry = _rehearse(tmp_path / "dry.json", "--dry-run", "--only", "recipe,tiny")
    for name in ("recipe", "tiny"):  # the dry run (CI) writes the keys this run wrote
        assert _key_paths(report[name]) == _key_paths(dry[name]), name
