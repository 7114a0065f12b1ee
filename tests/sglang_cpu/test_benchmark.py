"""benchmarks/sglang_cpu.py keeps working (its --quick mode): the table docs/benchmarks.md quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang_cpu

ROOT = Path(__file__).resolve().parents[2]


def test_sglang_cpu_benchmark_quick_mode():
    proc = subprocess.run(
        [sys.executable, "benchmarks/sglang_cpu.py", "--quick", "--base-port", "34000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny")]
    assert [row.split("|")[2].strip() for row in rows] == ["SGLang 0.5.23 (CPU)", "TorchEngine"]
    for row in rows:
        tok_s, publish = float(row.split("|")[4]), float(row.split("|")[6])
        assert tok_s > 0 and publish > 0
