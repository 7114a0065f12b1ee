"""scripts/compare_metrics.py: two runs' metrics.jsonl equal bit for bit, timing keys aside."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_metrics.py"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(a), str(b), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


ROW = {"step": 0, "train/loss": 0.1, "rollout/reward_mean": 0.25, "perf/step_s": 1.0}


def test_equal_runs_pass_and_timing_keys_are_not_compared(tmp_path):
    a = write(tmp_path / "a.jsonl", [ROW, ROW | {"step": 1}])
    later = [
        ROW | {"perf/step_s": 2.0, "rollout/wait_s": 3.0},
        ROW | {"step": 1, "perf/step_s": 9.0},
    ]
    b = write(tmp_path / "b.jsonl", later)
    proc = compare(a, b)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.strip() == "same: 2 rows, 3 keys compared"


def test_the_first_difference_is_named(tmp_path):
    a = write(tmp_path / "a.jsonl", [ROW, ROW | {"step": 1}])
    # one ulp apart: no tolerance
    b = write(tmp_path / "b.jsonl", [ROW, ROW | {"step": 1, "train/loss": 0.10000000000000002}])
    proc = compare(a, b)
    assert proc.returncode == 1
    assert proc.stdout.strip() == (
        "differ: row 1 (step 1): train/loss = 0.1 in A, 0.10000000000000002 in B"
    )
    assert compare(a, b, "--also-skip", "train/loss").returncode == 0


def test_missing_keys_rows_and_types_are_differences(tmp_path):
    a = write(tmp_path / "a.jsonl", [ROW])
    fewer = write(tmp_path / "b.jsonl", [{k: v for k, v in ROW.items() if k != "train/loss"}])
    proc = compare(a, fewer)
    assert proc.returncode == 1 and "keys only in A ['train/loss']" in proc.stdout
    longer = write(tmp_path / "c.jsonl", [ROW, ROW])
    assert "1 rows against 2 rows" in compare(a, longer).stdout
    as_int = write(tmp_path / "d.jsonl", [ROW | {"rollout/reward_mean": 0}])
    as_float = write(tmp_path / "e.jsonl", [ROW | {"rollout/reward_mean": 0.0}])
    assert compare(as_int, as_float).returncode == 1
