"""A 2-rank run stopped after a checkpoint and resumed with ``resume_from=latest`` equals the
uninterrupted 2-rank run: each rank's share of the models and optimizers (DCP shards), of the
correction's weight copies (EWMA's θ̄, KeepOldActor's snapshots: per-rank local shards), its RNG,
and its queue's batch generated ahead (sampled by the weights before the checkpoint).

Default suite: the run is stopped cleanly at step 2 (``total_steps=2``), both runs in one pair
of gloo processes. Slow: the real CLI under torchrun is SIGKILLed once its step-2 checkpoint is
written, mid-way through step 3, and resumed.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minippo.training.metrics import read_jsonl
from tests.helpers import REPO, free_port

SMALL = [
    "rollout.groups_per_batch=4",  # 2 prompts x 4 samples per rank
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=4",
    "progress_bar=false",
    "checkpoint.export_hf=false",
    "checkpoint.every_n_steps=2",
    "lr_scheduler.total_steps=4",  # the same LR schedule whether the run stops at 2 or 4
]
CORRECTIONS = {
    "ewma": [],
    "keep_old_actor": [
        "correction._component_=minippo.rl.correction.KeepOldActor",
        "~correction.reset_below",
    ],
}
# metrics that do not depend on timing
STABLE = ("train/", "correction/", "rollout/reward_mean", "rollout/response_len_mean")
STABLE += ("rollout/staleness_mean",)


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(STABLE)}


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        sa, sb = stable(ra), stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            nan = isinstance(sa[k], float) and math.isnan(sa[k]) and math.isnan(sb[k])
            assert nan or sa[k] == sb[k], (ra["step"], k, sa[k], sb[k])


def actor_weights(ckpt: Path, tmp: Path) -> dict:
    """The full actor weights of a DCP checkpoint (all ranks' shards)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp / f"{ckpt.parent.parent.name}.pt")
    return torch.load(tmp / f"{ckpt.parent.parent.name}.pt", weights_only=False)["actor"]


def _runs(rank: int, world: int, out: str) -> None:
    from minippo.config import load_config
    from tests.helpers import recipe_globals, shared_process_group

    main = recipe_globals()["recipe_main"]
    threads = torch.get_num_threads()
    with shared_process_group():  # the runs in turn
        for name, extra in CORRECTIONS.items():
            common = [*SMALL, "engine.in_process=true", "cpu_threads=1", *extra]
            full, part = f"{out}/{name}_full", f"{out}/{name}_part"
            for overrides in (
                [*common, "total_steps=4", f"output_dir={full}"],
                [*common, "total_steps=2", f"output_dir={part}"],  # stopped after step 2
                [*common, "total_steps=4", f"output_dir={part}", "resume_from=latest"],
            ):
                main(load_config("tiny_cpu", overrides))
                torch.set_num_threads(threads)


def test_two_rank_resume_equals_uninterrupted_two_rank_run(tmp_path, run_on_ranks):
    run_on_ranks(_runs, str(tmp_path))
    for name in CORRECTIONS:
        full, part = tmp_path / f"{name}_full", tmp_path / f"{name}_part"
        a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
        assert [r["step"] for r in a] == [0, 1, 2, 3]
        assert_same_rows(a, b)
        assert b[2]["rollout/staleness_mean"] == 1.0  # the saved batch, sampled before the stop
        final = "checkpoints/step_000004"
        wa = actor_weights(full / final, tmp_path)
        wb = actor_weights(part / final, tmp_path)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (name, k)
        for rank in (0, 1):  # each rank saved its own state (queue, correction shards, RNG)
            assert (part / "checkpoints" / "step_000004" / f"extra_rank{rank}.pt").is_file()


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux /proc), e.g. the ranks torchrun started."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


@pytest.mark.slow
def test_two_rank_run_killed_mid_step_resumes_like_the_uninterrupted_run(tmp_path):
    """SIGKILL the torchrun launcher and its 2 ranks once checkpoint 2 is complete (the run is
    then training step 3 or 4, or saving checkpoint 4), resume with resume_from=latest: metrics
    and final weights equal the uninterrupted run's. Linux (finds the ranks in /proc)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def command(out: Path, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "minippo._cli.main", "run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "async_ppo", "--config", "tiny_cpu",
            *SMALL, "total_steps=6", f"output_dir={out}", *extra,
        ]  # fmt: skip

    full, part = tmp_path / "full", tmp_path / "part"
    done = subprocess.run(command(full), capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(
        command(part), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    latest = part / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.is_file() and latest.read_text().strip() == "step_000002"):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint 2"
        time.sleep(0.05)
    victims = [proc.pid, *descendants(proc.pid)]  # the launcher and both ranks (own sessions)
    assert len(victims) >= 3, victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    resumed = subprocess.run(
        command(part, "resume_from=latest"), capture_output=True, text=True, cwd=REPO, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_rows(read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl"))
    final = "checkpoints/step_000006"
    wa, wb = actor_weights(full / final, tmp_path), actor_weights(part / final, tmp_path)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
