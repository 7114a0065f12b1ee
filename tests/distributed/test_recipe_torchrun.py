"""The recipe on 2 gloo ranks through the real CLI: FSDP2 actor + critic, one engine per rank."""

import math
import os
import subprocess
import sys
from pathlib import Path

from minippo.training.metrics import read_jsonl
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]


def test_two_process_torchrun_run(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "minippo._cli.main", "run",
            "--nproc-per-node", "2", "--master-port", str(free_port()),
            "async_ppo", "--config", "tiny_cpu",
            "total_steps=2", f"output_dir={out}",
            "rollout.groups_per_batch=8", "ppo.minibatches=2", "ppo.micro_batch_size=8",
            "rollout.samples_per_prompt=4", "progress_bar=false", "engine.in_process=true",
        ],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")  # rank 0 alone writes it
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert math.isfinite(r["train/policy_loss"]) and math.isfinite(r["train/value_loss"])
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    assert rows[1]["rollout/staleness_mean"] == 1.0
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "extra_rank0.pt").is_file() and (ckpt / "extra_rank1.pt").is_file()
    assert (out / "hf_export" / "model.safetensors").is_file()  # gathered from both ranks


def test_nproc_per_node_1_launches_a_one_rank_process_group(tmp_path):
    """`minippo run --nproc-per-node 1` (torchrun's default value, given explicitly) starts one
    rank under torchrun: a process group, so dtype=bf16 (FSDP2 mixed precision, which a plain
    process refuses) trains; the 1-GPU configs are launched this way."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PET_MASTER_PORT"] = str(free_port())  # torchrun's --master-port default, not a flag
    proc = subprocess.run(
        [
            sys.executable, "-m", "minippo._cli.main", "run", "--nproc-per-node", "1",
            "async_ppo", "--config", "tiny_cpu", "dtype=bf16",
            "total_steps=1", f"output_dir={out}", "rollout.groups_per_batch=8",
            "rollout.samples_per_prompt=4",
            "ppo.minibatches=2", "progress_bar=false", "engine.in_process=true",
            "checkpoint.export_hf=false",
        ],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and math.isfinite(rows[0]["train/policy_loss"])
