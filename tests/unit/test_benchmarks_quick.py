"""Every benchmark script runs in its ``--quick`` mode and prints its table, so none of them rots.

Each script runs in a subprocess (with a timeout) from the repository root; scratch output goes to
a temporary TMPDIR. The selected scripts run two at a time (their tables are checked, not their
timings; two processes overlap the seconds each spends importing torch): 0.67x the serial wall
time of four of them on a 2-core AMD EPYC. Scripts whose quick mode takes longer than ~20 s on an
unloaded 2-core machine are marked ``slow`` (run them with ``pytest -m slow``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))

# What each script's table must contain (scripts not listed only need a table-like output).
MARKERS = {
    "corrections_study.py": ["| staleness | method | final reward", "| 0 | none |", "| 1 | ewma |"],
    "perf.py": [
        "| figure | ours | baseline | ratio | goal |",
        "engine decode tokens/s",
        "async / sync steps/s",
        "EWMA update",
        "PPO update tokens/s",
        "PPO update tokens/s, fused loss",
        "PPO fwd+bwd peak tensor MiB, fused loss",
    ],
    "memory.py": ["| method | max_staleness | peak RSS MiB", "| keep_old_actor | fp32 | 1 |"],
    "engine_throughput.py": ["ratio TorchEngine / HF"],
    "engine_kernel_cache.py": [
        "| onednn_cache_capacity | tok/s (median wave) |",
        "| 1024 |",
        "| 64 |",
    ],
    "correction_cost.py": ["EWMA update", "snapshot save"],
    "logprob_memory.py": ["| naive |", "| chunked |", "| fused |"],
    "host_memory.py": ["| meta + per-tensor load | 1 |", "ratio (peak - baseline)"],
    "reward_speed.py": ["| numbers | 1000 |", "| latex | 1000 |", "s per 10,000"],
    "long_tail.py": [
        "p99/p50",
        "| oversample | decode steps / trained sample |",
        "| 1.25 |",
        "| 1.5 |",
        "\nratio: ",
    ],
    "vs_trl.py": [
        "| minippo sync |",
        "| minippo async |",
        "| TRL GRPOTrainer, 1 thread |",
        "| gen s/step | update s/step |",
    ],
    "packing.py": [
        "| padded |",
        "| packed, budget |",
        "real/processed: 1.000 (padded: ",
        "\nspeedup: ",
        "\nrank tokens max/mean: sampled ",
    ],
    "step_overhead.py": [
        "| phase | wall ms | matmul/attention ms | non-matmul ms |",
        "| publish |",
        "| **step** |",
        "main-thread CPU ms",
    ],
}
# Scripts that compare against an optional package (the `bench` extra): skipped without it.
NEEDS = {"vs_trl.py": "trl"}
# Scripts whose quick mode runs in another lane, where what they measure is installed.
OTHER_LANES = {"sglang_cpu.py": "tests/sglang_cpu/test_benchmark.py"}  # the real SGLang engine
# Quick modes slower than ~20 s on an unloaded 2-core machine. In the default suite on a 2-core
# AMD EPYC (2026-12-07, one at a time, seconds): perf 18, host_memory 16, logprob_memory 15,
# step_overhead 14, engine_kernel_cache 14, correction_cost 12, corrections_study 12,
# engine_throughput 9, long_tail 6, packing 5, reward_speed 4 (~125 s in all; two at a time
# ~0.7 of that); optimizer_memory 28 and memory 25 (slow), and the two scripts that run the whole
# recipe per seed (learning_sweep, main_job_time) ~10-20 s each: slow too.
SLOW = {"optimizer_memory.py", "memory.py", "learning_sweep.py", "main_job_time.py"}
TIMEOUT_S = 900


def _table_like(text: str) -> bool:
    """A markdown table row, or two lines that each hold at least two numbers."""
    lines = text.splitlines()
    if any(line.startswith("|") and line.count("|") >= 3 for line in lines):
        return True
    numeric = [line for line in lines if len(re.findall(r"\d+\.?\d*", line)) >= 2]
    return len(numeric) >= 2


def test_every_script_is_covered():
    assert {"corrections_study.py", "perf.py", "memory.py"} <= set(SCRIPTS), SCRIPTS
    assert set(MARKERS) <= set(SCRIPTS)
    for script, test in OTHER_LANES.items():
        assert script in SCRIPTS and (REPO / test).read_text().count(script), (script, test)


def _quick(script: str, tmp: Path) -> subprocess.CompletedProcess | str:
    """``benchmarks/<script> --quick``; the failure's text if it ran past TIMEOUT_S."""
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    try:
        return subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), "--quick"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return f"{script} --quick did not finish in {TIMEOUT_S} s:\n{(e.stdout or '')[-3000:]}"


@pytest.fixture(scope="module")
def quick_runs(request, tmp_path_factory) -> dict:
    """The quick run of every script this session selected, two at a time: script -> result."""
    test = "test_quick_mode_runs_and_prints_its_table"
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", None) == test and item.module is request.module
    ]
    runnable = [
        s for s in selected if s not in NEEDS or importlib.util.find_spec(NEEDS[s]) is not None
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {s: pool.submit(_quick, s, tmp_path_factory.mktemp(s)) for s in runnable}
        return {s: f.result() for s, f in futures.items()}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
        for s in SCRIPTS
        if s not in OTHER_LANES
    ],
)
def test_quick_mode_runs_and_prints_its_table(script, quick_runs):
    if script in NEEDS:
        pytest.importorskip(
            NEEDS[script], reason=f"{script} needs {NEEDS[script]} (the bench extra)"
        )
    proc = quick_runs[script]
    if isinstance(proc, str):
        pytest.fail(proc)
    out = proc.stdout
    assert proc.returncode == 0, (
        f"{script} --quick exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    )
    assert _table_like(out), f"{script} --quick printed no table:\n{out[-3000:]}"
    for marker in MARKERS.get(script, []):
        assert marker in out, f"{script} --quick output lacks {marker!r}:\n{out[-3000:]}"
