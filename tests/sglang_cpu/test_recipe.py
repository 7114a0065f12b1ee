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
from tests.recipes.test_alternate_mode import SCRIPT as SPANS  # a third of the ids end a response
from tests.recipes.test_async_ppo import REPO, _env, cli

pytestmark = pytest.mark.sglang_cpu

QUIET = ["progress_bar=false", "checkpoint.export_hf=false"]
ALTERNATE = ["rollout.mode=alternate", "rollout.oversample=1.5", "rollout.partial_rollout=true"]


def final_reward(rows: list[dict]) -> float:
    return sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5


# tiny_sglang_cpu samples 8 responses per prompt (as tiny_cpu). With 4, one run in ~12
# stalled near 0.75: one copy symbol's probability falls near 0 early and is never sampled again
# (tiny_cpu over seeds 0-59: 5 of 60; SGLang alternate: 3 of 19). With 8 the measured runs all
# ended >= 0.8 (tiny_cpu with samples_per_prompt=8, seeds 0-59: lowest 0.871; SGLang, unseeded:
# 19 runs, lowest 0.822: a two-rank run that hovered near 0.75 for ~25 steps, then recovered;
# docs/sglang_backend.md). The lane asserts 0.7, from chance (~0.02): a run that learns nothing,
# or loses two of the 4 symbols (<= 0.5), fails; one slow symbol at step 60 (~0.75) does not fail
# CI, the docs report the 0.8 rate.
LEARNED = 0.7


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
    """From chance (~0.02) to at least 3 of the 4 symbols over the last 5 of the 60 steps (runs
    measured >= 0.82, LEARNED above): in one process, and with two ranks (one real engine each,
    FSDP2 on gloo)."""
    rows = learning_run(tmp_path / "run", launch)
    assert final_reward(rows) >= LEARNED, [round(r["rollout/reward_mean"], 3) for r in rows]


def test_tiny_sglang_cpu_alternate_learns(tmp_path):
    """The GPU schedule (alternate, oversampled groups, partial rollouts) learns from chance
    (LEARNED above; runs measured >= 0.996), carrying unfinished samples into the next step."""
    rows = learning_run(tmp_path / "run", overrides=ALTERNATE)
    assert sum(r["rollout/carried_over"] for r in rows) > 0
    assert final_reward(rows) >= LEARNED, [round(r["rollout/reward_mean"], 3) for r in rows]


# tiny_multiturn_cpu's retry-with-feedback task on tiny_sglang_cpu's engine and settings
MULTI_TURN = [
    "dataset.op=reverse", "dataset.length=3", "rollout.max_new_tokens=11",
    "+env._component_=minippo.data.tasks.RetryWithFeedback", "+multi_turn.max_turns=2",
    "+multi_turn.max_turn_tokens=3",
]  # fmt: skip


def test_multi_turn_episodes_learn_on_the_real_engine(tmp_path):
    """Multi-turn episodes through the real engine: every turn a request of the exact context so
    far with the turn's stop ids, the environment's hint as observation tokens in between; from
    chance (~0.02) to LEARNED over the last 5 of 60 steps (docs/multi_turn.md "Results")."""
    rows = learning_run(tmp_path / "run", overrides=MULTI_TURN)
    assert all(1.0 <= r["rollout/turns_mean"] <= 2.0 for r in rows)
    assert max(r["rollout/obs_tokens_mean"] for r in rows) > 0
    assert final_reward(rows) >= LEARNED, [round(r["rollout/reward_mean"], 3) for r in rows]


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


def test_multi_turn_episodes_in_the_alternate_schedule_keep_their_versions(tmp_path):
    """Multi-turn episodes on the real engine in the alternate schedule: unfinished episodes are
    carried into the next step with their environment state, and keep_old_actor scores every
    model token with the snapshot of the version that sampled it, across turns (0 mismatches)."""
    out = tmp_path / "run"
    proc = cli(
        "run", "async_ppo", "--config", "tiny_sglang_cpu", *QUIET, *MULTI_TURN, *ALTERNATE,
        "correction._component_=minippo.rl.correction.KeepOldActor", "~correction.reset_below",
        "total_steps=6", f"output_dir={out}", timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 6
    assert all(r["rollout/carried_over"] > 0 for r in rows)
    assert all(1.0 < r["rollout/turns_mean"] <= 2.0 for r in rows)
    assert all(r["correction/version_mismatches"] == 0.0 for r in rows)
    assert max(r["rollout/staleness_mean"] for r in rows) > 0  # carried tokens of an older version
