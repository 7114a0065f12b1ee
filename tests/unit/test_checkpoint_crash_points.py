"""Crash safety by fault injection: a process SIGKILLed at every write point of the end of a
training step (the metrics line, each DCP file, the DCP metadata, the extra state, meta.json, the
rename, the ``latest`` pointer, the pruning, the HF export) leaves a folder from which
``resume_from=latest`` resumes the last complete checkpoint, bit for bit, every time.
The cases run in one subprocess (tests/crash_points.py: a forked child per kill point)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from minippo.training.metrics import JsonlLogger, read_jsonl

REPO = Path(__file__).resolve().parents[2]

# the write points the kill must visit (a changed save adds or renames events: update the list
# only after checking that the new event is covered)
REQUIRED = [
    "metrics line step 1",
    "open checkpoints/step_000002.tmp/__0_0.distcp",
    "rename checkpoints/step_000002.tmp/.metadata.tmp -> checkpoints/step_000002.tmp/.metadata",
    "torch.save checkpoints/step_000002.tmp/extra_rank0.pt",
    "replace checkpoints/step_000002.tmp/meta.json.tmp -> checkpoints/step_000002.tmp/meta.json",
    "rename checkpoints/step_000002.tmp -> checkpoints/step_000002",
    "open checkpoints/latest.tmp",
    "replace checkpoints/latest.tmp -> checkpoints/latest",
    "rmtree checkpoints/step_000001",
    "open hf_export.tmp/config.json",
    "safetensors hf_export.tmp/model.safetensors",
    "rename hf_export.tmp -> hf_export",
]


def test_kill_at_every_write_point_then_resume_from_latest(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.crash_points", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(lines[-1][len("RESULT=") :])
    events = [r["event"] for r in results]
    missing = [e for e in REQUIRED if e not in events]
    assert not missing, f"write points not visited: {missing}"
    failed = [r for r in results if r["error"] is not None]
    assert not failed, "\n".join(f"{r['event']} ({r['mode']}): {r['error']}" for r in failed)
    # a kill before the `latest` pointer is replaced resumes checkpoint 1, after it checkpoint 2
    by_point = {(r["event"], r["mode"]): r["expected_step"] for r in results}
    assert by_point[("rename checkpoints/step_000002.tmp -> checkpoints/step_000002", "after")] == 1
    assert by_point[("replace checkpoints/latest.tmp -> checkpoints/latest", "before")] == 1
    assert by_point[("replace checkpoints/latest.tmp -> checkpoints/latest", "after")] == 2
    assert ("metrics line step 1", "torn") in by_point


def test_a_metrics_line_cut_short_is_dropped_when_the_run_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')
    logger = JsonlLogger(path)  # resumed at step 2 (checkpoint 2): rows 0 and 1 stay
    logger.log({"a": 3.0}, step=2)
    logger.close()
    assert [(r["step"], r["a"]) for r in read_jsonl(path)] == [(0, 1.0), (1, 2.0), (2, 3.0)]
