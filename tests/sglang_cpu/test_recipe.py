"""The recipe with the real SGLang engine on the CPU: configs/tiny_sglang_cpu.yaml learns in one
process, with two ranks (one engine each, FSDP2 on gloo) and on the GPU schedule (alternate,
oversampled groups, partial rollouts); keep_old_actor anchors every token of a sample that spans
versions with the snapshot of its own version."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

import pytest

from minippo.engine._sglang_process import GPU_KERNEL_IMPORT_WARNINGS
from minippo.training.metrics import read_jsonl
from tests.recipes.seeds import SEEDS, check_learns
from tests.recipes.test_alternate_mode import SCRIPT as SPANS  # a third of the ids end a response
from tests.recipes.test_async_ppo import REPO, _env, cli

pytestmark = pytest.mark.sglang_cpu

QUIET = ["progress_bar=false", "checkpoint.export_hf=false"]
ALTERNATE = ["rollout.mode=alternate", "rollout.oversample=1.5", "rollout.partial_rollout=true"]


def final_reward(rows: list[dict]) -> float:
    return sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5


# The alternate schedule's final reward (mean of the last 5 of 60 steps) in the first five unseeded
# runs by hand (SGLang samples without per-request seeds on a CPU, so no two runs are alike),
# 2026-12-03, Intel Xeon: m 0.906, s 0.123. A run of this task either learns (>= 0.9) or stalls near
# 0.74: one of the 4 symbols collapses onto another (its probability ~0.02, so almost no sample
# carries a signal for it before the 60 steps end). The stall is the task's, not the engine's:
# TorchEngine's tiny_cpu stalls in 5 of 82 runs whose sampling streams were varied (overlap and
# alternate), and changing the lr, clip_high, epochs or minibatches only moves it to other streams;
# SGLang alternate stalled in 3 of 19 runs (docs/sglang_backend.md). Three runs are checked with
# the bounds of tests/recipes/seeds.py from those five runs: their mean >= m - 2 s / sqrt(3) =
# 0.764 (fails when all three stall, ~0.3% at 3 in 19), each >= m - 3 s = 0.537 (at most one symbol
# lost).
ALTERNATE_LAST_5 = [0.998, 0.9868, 0.8126, 0.9968, 0.7367]


def learning_run(out, launch: Sequence[str] = (), overrides: Sequence[str] = ()) -> list[dict]:
    """tiny_sglang_cpu through the CLI into ``out`` (``launch``: the launcher's flags); checks
    that the run ends cleanly and starts from chance, and returns its 60 metric rows."""
    proc = cli(
        "run", *launch, "async_ppo", "--config", "tiny_sglang_cpu", f"output_dir={out}",
        *QUIET, *overrides, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # the engine's end included
    # SGLang's "no GPU kernel" import warnings, from every engine process, are not the user's
    assert not any(w in proc.stderr for w in GPU_KERNEL_IMPORT_WARNINGS), proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 60 and rows[0]["rollout/reward_mean"] < 0.1
    return rows


@pytest.mark.parametrize(
    "launch", [(), ("--nproc-per-node", "2")], ids=["one-process", "two-ranks"]
)
def test_tiny_sglang_cpu_learns(tmp_path, launch):
    """From chance (~0.02) to at least 3 of the 4 symbols over the last 5 of the 60 steps: a run
    learns (>= 0.9, as tiny_cpu with TorchEngine) or, now and then on either engine, stalls near
    0.74 with one symbol collapsed onto another (the comment above ALTERNATE_LAST_5); 0.7 passes
    one lost symbol and fails two (<= 0.5) or no learning."""
    rows = learning_run(tmp_path / "run", launch)
    assert final_reward(rows) >= 0.7, [round(r["rollout/reward_mean"], 3) for r in rows]


def test_tiny_sglang_cpu_alternate_learns(tmp_path):
    """The GPU schedule (alternate, oversampled groups, partial rollouts) learns from chance, over
    seeds 0-2 (unseeded sampling: three independent runs) against the measured runs' spread; each
    run carries unfinished samples into the next step."""
    final = {}
    for seed in SEEDS:
        rows = learning_run(tmp_path / f"seed{seed}", overrides=[*ALTERNATE, f"seed={seed}"])
        assert sum(r["rollout/carried_over"] for r in rows) > 0
        final[seed] = final_reward(rows)
    check_learns(final, ALTERNATE_LAST_5, "alternate on SGLang: mean reward, last 5 steps")


def test_keep_old_actor_anchors_samples_that_span_versions(tmp_path):
    """The alternate schedule on the real engine carries unfinished samples into the next step;
    keep_old_actor scores each of their tokens with the snapshot of the version that sampled it
    (version mismatches 0 in every step), and keeps only the snapshots still referenced."""
    out = tmp_path / "run"
    overrides = [
        *QUIET,
        *ALTERNATE,
        "total_steps=8",
        f"output_dir={out}",
        "rollout.max_new_tokens=12",
        "correction._component_=minippo.rl.correction.KeepOldActor",
        "~correction.reset_below",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SPANS,
            str(REPO / "recipes/async_ppo.py"),
            json.dumps(overrides),
            "tiny_sglang_cpu",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 8
    assert max(r["rollout/multi_version_fraction"] for r in rows) > 0  # a sample spans versions
    for r in rows:
        assert r["correction/version_mismatches"] == 0.0
        assert r["rollout/staleness_max"] <= 1
        assert 1 <= r["correction/snapshot_versions"] <= 2
