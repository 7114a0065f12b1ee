"""Two "nodes" on this machine: two ``minippo run --nnodes 2 --nproc-per-node 1`` launchers meet
through a c10d rendezvous on localhost and train the tiny recipe with ``parallel.sharding=hsdp``
(mesh (2, 1): one replica per node). Their metrics equal those of one launcher with 2 ranks and
``parallel.sharding=fsdp`` (mesh (2,): each rank half of every tensor), and each "node" writes its
outputs as docs/multinode.md says (node-local output folders, ``parallel.shared_output_dir=false``).

Why the metrics are equal, and where they may differ (docs/multinode.md "What is verified"):
both runs give rank r the same prompts, seeds, engine and rows; a forward uses the same full
weights (gathered from halves, or held whole); the gradient of a weight is the sum of the two
ranks' terms (a + b, by reduce-scatter or by all-reduce: the same float32 sum); AdamW is
elementwise, so it computes the same values on halves as on whole tensors. One micro-batch per
minibatch, so HSDP's deferred all-reduce (once per minibatch) adds the same two terms. Clipping
is off (``ppo.max_grad_norm=1e9``: the factor is exactly 1.0). So every metric is equal bit for
bit except the norms computed from local shards, which add the same squares in another order:
``train/grad_norm`` (‖g‖ of each tensor in one pass, or from the norms of two halves) and
``correction/ewma_distance``. A float32 sum of n squares is within (n − 1)·u of the exact sum
(u = 2⁻²⁴) in any order, so each norm is within (n − 1)·u/2 + u and the two within (n + 1)·u
relative, n the largest tensor's elements; the total over K tensors adds (K + 1)·u. A gradient
summed twice over the replicas (×2) or a distance that counts each replica (×√2) is far beyond.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minippo.training.metrics import read_jsonl
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
# tiny_cpu, small: 8 prompts x 4 samples = 16 rows per rank, 2 minibatches of one micro-batch
COMMON = [
    "async_ppo", "--config", "tiny_cpu",
    f"total_steps={STEPS}",
    "rollout.groups_per_batch=8", "ppo.minibatches=2", "ppo.micro_batch_size=8",
    "rollout.samples_per_prompt=4",
    "ppo.max_grad_norm=1e9", "cpu_threads=1", "engine.in_process=true",
    "progress_bar=false", "checkpoint.export_hf=false",
]  # fmt: skip
U = torch.finfo(torch.float32).eps / 2
LOCAL_NORMS = ("train/grad_norm", "train/critic_grad_norm", "correction/ewma_distance")
PER_RANK_BYTES = ("correction/ewma_bytes", "correction/swap_buffer_bytes")
# queue counters and timings depend on the scheduler, not on the arithmetic
TIMING = ("perf/",)
STABLE_ROLLOUT = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/staleness_mean")


def _env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "minippo._cli.main", "run", *args]


def _run_together(cmds: list[list[str]], timeout: float) -> None:
    """Start every command at once (the "nodes" meet at the rendezvous); all must succeed."""
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for cmd in cmds
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def _two_nodes(tmp_path: Path) -> list[Path]:
    """Both launchers at once; each "node" has its own output_dir (a node-local disk)."""
    port, dirs, cmds = free_port(), [], []
    for node in (0, 1):
        out = tmp_path / f"node{node}"
        dirs.append(out)
        cmds.append(_cli(
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"two-nodes-{port}",
            *COMMON, f"output_dir={out}", "parallel.sharding=hsdp",
            "parallel.shared_output_dir=false",
        ))  # fmt: skip
    _run_together(cmds, timeout=400)
    return dirs


def _one_node(out: Path) -> None:
    cmd = _cli(
        "--nproc-per-node", "2", "--master-port", str(free_port()),
        *COMMON, f"output_dir={out}", "parallel.sharding=fsdp",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _norm_bound() -> float:
    """(n + K + 3)·u: n the largest tensor's elements, K the tensors (module docstring)."""
    from minippo.models import Transformer, qwen3_tiny

    with torch.device("meta"):
        sizes = [p.numel() for p in Transformer(qwen3_tiny(vocab_size=51)).parameters()]
    return (max(sizes) + len(sizes) + 3) * U


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Actor and critic weights and optimizer states of a checkpoint, loaded by one process."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from minippo.models import Transformer, ValueModel, qwen3_tiny
    from minippo.training.checkpoint import Checkpointer

    args = qwen3_tiny(vocab_size=51)
    models = {}
    for name, cls in (("actor", Transformer), ("critic", ValueModel)):
        m = cls(args)
        models[name] = (m, torch.optim.AdamW(m.parameters()))
    Checkpointer(path.parent).load_models(path, models=models)
    out = {}
    for name, (m, opt) in models.items():
        msd, osd = get_state_dict(m, opt)
        out |= {f"{name}.{k}": v for k, v in msd.items()}
        for pid, state in osd["state"].items():
            out |= {f"{name}.opt.{pid}.{k}": v for k, v in state.items() if torch.is_tensor(v)}
    return out


ECHO = """\
import json, os
from minippo.config import parse_recipe_args

cfg = parse_recipe_args()
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MINIPPO_LAUNCHER_CHECKED")
with open(os.path.join(cfg.output_dir, f"rank_{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "seed": cfg.seed}, f)
"""


def test_two_launchers_with_a_static_rendezvous_number_the_ranks_by_node(tmp_path):
    """--node-rank, --master-addr and --master-port reach torchrun: node i's rank is global
    rank i, each node has one local rank, and both ranks got the same config."""
    import json

    recipe, cfg = tmp_path / "echo.py", tmp_path / "echo.yaml"
    recipe.write_text(ECHO)
    cfg.write_text(f"output_dir: {tmp_path}\nseed: 1\n")
    port, cmds = free_port(), []
    for node in (0, 1):
        cmds.append(_cli(
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(recipe), "--config", str(cfg), "seed=7",
        ))  # fmt: skip
    _run_together(cmds, timeout=120)
    for node in (0, 1):
        got = json.loads((tmp_path / f"rank_{node}.json").read_text())
        assert got["seed"] == 7
        assert got["env"] == {
            "RANK": str(node), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(node), "MINIPPO_LAUNCHER_CHECKED": "1",
        }  # fmt: skip


@pytest.mark.slow  # ~25 s of four processes; distributed/test_hsdp.py keeps HSDP in the default suite
def test_two_launchers_hsdp_equal_one_launcher_fsdp(tmp_path):
    nodes = _two_nodes(tmp_path)
    _one_node(tmp_path / "one")

    # output files by global rank 0 only: the rendezvous decides which launcher holds it
    with_metrics = [d for d in nodes if (d / "metrics.jsonl").exists()]
    assert len(with_metrics) == 1, [sorted(p.name for p in d.iterdir()) for d in nodes]
    two = read_jsonl(with_metrics[0] / "metrics.jsonl")
    one = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(STEPS))
    bound = _norm_bound()
    for a, b in zip(two, one):
        assert a.keys() == b.keys()
        for k in a:
            if k.startswith(TIMING) or (k.startswith("rollout/") and k not in STABLE_ROLLOUT):
                continue
            if k in LOCAL_NORMS:
                assert math.isclose(a[k], b[k], rel_tol=bound), (a["step"], k, a[k], b[k])
            elif k in PER_RANK_BYTES:  # HSDP (2, 1): whole tensors on each rank, FSDP: halves
                assert a[k] == 2 * b[k], (k, a[k], b[k])
            elif not (math.isnan(a[k]) and math.isnan(b[k])):
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
    assert two[-1]["correction/ewma_distance"] > 0 and two[0]["train/grad_norm"] > 0

    # node-local checkpoints: each node's folder holds its own rank's part and a meta.json
    step = f"step_{STEPS:06d}"
    ranks = []
    for d in nodes:
        ckpt = d / "checkpoints" / step
        assert (d / "checkpoints" / "latest").read_text().strip() == step
        extra = sorted(p.name for p in ckpt.glob("extra_rank*.pt"))
        assert len(extra) == 1, extra
        ranks.append(int(extra[0][len("extra_rank") : -3]))
    assert sorted(ranks) == [0, 1]
    rank1 = nodes[ranks.index(1)] / "checkpoints" / step
    assert not (rank1 / ".metadata").exists()  # DCP's metadata is on rank 0's node only
    from minippo.training.checkpoint import CorruptCheckpointError, verify_checkpoint

    try:
        verify_checkpoint(rank1)
        raise AssertionError("a node's folder alone must not verify")
    except CorruptCheckpointError as e:
        assert "copy the step folder of every node into one folder" in str(e)

    # merged, it is one checkpoint; its weights and AdamW states are the 2-rank FSDP run's
    merged = tmp_path / "merged" / step
    for d in nodes:
        shutil.copytree(d / "checkpoints" / step, merged, dirs_exist_ok=True)
    meta = verify_checkpoint(merged)
    assert (meta["world_size"], meta["shard_ranks"], meta["output_dir_shared"]) == (2, 1, False)
    hsdp, fsdp = _weights(merged), _weights(tmp_path / "one" / "checkpoints" / step)
    assert hsdp.keys() == fsdp.keys() and len(hsdp) > 20
    for k in hsdp:
        assert torch.equal(hsdp[k], fsdp[k]), k
