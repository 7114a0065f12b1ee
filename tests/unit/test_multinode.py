"""Several nodes without a second machine: what ``minippo run`` forwards to torchrun, the
``parallel`` section and the mesh helpers, the layout a resume needs, the contract warning once
per node, and the bytes ``minippo plan nnodes=N`` says a step sends across nodes.

The cross-node bytes are recomputed here from the model's parameter counts and the config, with
the ring formulas of docs/multinode.md written out: (W − 1)/W · S per node for an all-gather or a
reduce-scatter over all W ranks, 2(n − 1)/n · S for HSDP's all-reduce across n nodes.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from minippo._cli import main as cli
from minippo._cli.main import main
from minippo.config import load_config
from minippo.parallel import shard_ranks, sharding_of
from minippo.plan import plan_from_config
from minippo.training.preflight import (
    ASYNC_PPO_SCHEMA,
    LAUNCHER_CHECKED_ENV,
    config_problems,
    input_problems,
)

FLAGS = (
    "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
)  # fmt: skip


def test_run_help_lists_the_multinode_flags(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert f"  {flag} " in out, flag
    assert "docs/multinode.md" in out


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """``minippo run`` up to torchrun: returns the namespace torchrun would get."""
    seen = {}

    def fake_launch(largs):
        seen["largs"] = largs
        return 0

    monkeypatch.setattr(cli, "_launch", fake_launch)
    monkeypatch.setenv(LAUNCHER_CHECKED_ENV, "0")  # restored after the test
    common = ["async_ppo", "--config", "tiny_cpu", f"output_dir={tmp_path}"]

    def run(*flags: str, overrides: tuple[str, ...] = ()) -> object:
        assert main(["run", *flags, *common, *overrides]) == 0
        return seen["largs"]

    return run


def test_static_rendezvous_flags_reach_torchrun_unchanged(launched):
    largs = launched(
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
        "--master-addr", "10.1.2.3", "--master-port", "29511", "--max-restarts", "2",
        overrides=("ppo.micro_batch_size=8",),  # 4 ranks: 8 rows per minibatch and rank
    )  # fmt: skip
    assert (largs.nnodes, largs.node_rank, largs.nproc_per_node) == ("2", 1, "2")
    assert (largs.master_addr, largs.master_port, largs.max_restarts) == ("10.1.2.3", 29511, 2)
    assert largs.rdzv_backend == "static"
    assert largs.training_script.endswith("async_ppo.py")
    assert largs.training_script_args[-1] == "ppo.micro_batch_size=8"
    import os

    assert os.environ[LAUNCHER_CHECKED_ENV] == "1"  # the ranks do not repeat the warnings


def test_c10d_rendezvous_flags_reach_torchrun_unchanged(launched):
    largs = launched(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0.cluster:29400", "--rdzv-id", "job-17",
    )  # fmt: skip
    assert (largs.rdzv_backend, largs.rdzv_endpoint, largs.rdzv_id) == (
        "c10d",
        "node0.cluster:29400",
        "job-17",
    )
    assert (largs.nnodes, largs.nproc_per_node) == ("2", "1")


def test_the_launcher_checks_the_batch_for_every_rank_of_every_node(capsys, tmp_path):
    # 2 nodes x 2 ranks: 32 rows per rank, 8 per minibatch, not divisible by micro-batches of 16
    rc = main(
        ["run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "h", "--master-port",
         "1", "async_ppo", "--config", "tiny_cpu", f"output_dir={tmp_path}",
         "rollout.samples_per_prompt=4", "ppo.micro_batch_size=16"]
    )  # fmt: skip
    assert rc == 2
    assert "minibatch rows (8) must be divisible by ppo.micro_batch_size (16)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--nnodes", "2", "--master-port", "0"], "the other nodes cannot know"),
        (["--nnodes", "1:2"], "needs a fixed number of nodes"),
    ],
)
def test_launches_minippo_cannot_run_are_refused_in_one_line(flags, phrase, capsys, tmp_path):
    rc = main(["run", *flags, "async_ppo", "--config", "tiny_cpu", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and phrase in err and len(err.strip().splitlines()) == 1, err


def test_the_parallel_section_is_checked_with_its_fix():
    cfg = load_config("tiny_cpu", ["parallel.sharding=zero"])
    problems = config_problems(cfg, ASYNC_PPO_SCHEMA)
    assert len(problems) == 1 and "parallel.sharding" in problems[0] and "hsdp" in problems[0]
    assert not config_problems(
        load_config("tiny_cpu", ["parallel.sharding=hsdp"]), ASYNC_PPO_SCHEMA
    )
    assert not config_problems(load_config("tiny_cpu", ["~parallel"]), ASYNC_PPO_SCHEMA)
    assert sharding_of(load_config("tiny_cpu", ["~parallel"])) == "fsdp"


def test_shard_ranks_follow_the_sharding():
    assert shard_ranks("fsdp", 16, 8) == 16
    assert shard_ranks("hsdp", 16, 8) == 8
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        shard_ranks("hsdp", 12, 8)
    with pytest.raises(ValueError, match="must be one of fsdp, hsdp"):
        shard_ranks("zero", 2, 1)


def test_resume_needs_the_layout_that_saved_the_checkpoint(tmp_path):
    from minippo.training.checkpoint import Checkpointer

    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    path = ckpt.save(1, models={"m": (model, None)}, states={})
    # as written by HSDP on 2 nodes x 1 rank: 2 ranks, parameters split over 1
    meta = json.loads((path / "meta.json").read_text())
    assert meta["shard_ranks"] == 1
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    (path / "extra_rank1.pt").write_bytes((path / "extra_rank0.pt").read_bytes())

    base = [f"output_dir={tmp_path}", "resume_from=latest"]
    fsdp = input_problems(load_config("tiny_cpu", base), world_size=2, local_world_size=2)
    assert len(fsdp) == 1, fsdp
    assert "split over 1 ranks, this run would split them over 2" in fsdp[0]
    assert "parallel.sharding=hsdp on 2 node(s) x --nproc-per-node 1" in fsdp[0]
    hsdp = load_config("tiny_cpu", [*base, "parallel.sharding=hsdp"])
    assert input_problems(hsdp, world_size=2, local_world_size=1) == []
    # the same 2 ranks on one node under HSDP split over 2: refused as well
    assert input_problems(hsdp, world_size=2, local_world_size=2)


def test_the_contract_warning_is_printed_by_the_launcher_not_again_by_its_ranks(monkeypatch):
    cfg = load_config("tiny_cpu", ["advantage_estimator=grpo", "correction=null"])
    monkeypatch.delenv(LAUNCHER_CHECKED_ENV, raising=False)
    with pytest.warns(UserWarning, match="Critic-free async run"):
        assert config_problems(cfg, ASYNC_PPO_SCHEMA) == []
    monkeypatch.setenv(LAUNCHER_CHECKED_ENV, "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert config_problems(cfg, ASYNC_PPO_SCHEMA) == []
    assert not [w for w in seen if "Critic-free" in str(w.message)]


def _numels(critic: bool) -> tuple[int, int]:
    """(all parameters, decoder blocks) of the tiny actor or critic, counted on a meta model."""
    from minippo.models import Transformer, ValueModel, qwen3_tiny

    with torch.device("meta"):
        m = (ValueModel if critic else Transformer)(qwen3_tiny(vocab_size=51))
    return sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.layers.parameters())


def test_plan_counts_the_bytes_a_step_sends_across_nodes():
    # 2 nodes x 2 ranks; 32 prompts x 4 / 4 ranks = 32 rows per rank; 4 minibatches of 8 rows in
    # micro-batches of 4: 8 micro-batches and 4 optimizer steps per step; no-grad passes over
    # the whole batch: 1 forward each (critic values, the correction's scoring passes)
    cfg = load_config("tiny_cpu", ["rollout.samples_per_prompt=4", "ppo.micro_batch_size=4"])
    plan = plan_from_config(cfg, world_size=2, nnodes=2)
    (na, ba), (nc, bc) = _numels(False), _numels(True)
    c, r, e = 4, 4, 4  # fp32 compute, fp32 gradient reduction, fp32 engine
    ring, micro, opt_steps = 3 / 4, 8, 4
    passes = plan.inputs.correction.scoring_passes
    assert passes >= 1
    want_fsdp = {
        "parameter all-gathers, training": ring * micro * (na + ba + nc + bc) * c,
        "parameter all-gathers, no-grad passes": ring * (nc + passes * na) * c,
        "gradients: fsdp reduce-scatter, hsdp all-reduce": ring * micro * (na + nc) * r,
        "weight publish (all-gather)": ring * na * e,
    }
    want_hsdp = {k: 0 for k in want_fsdp}
    want_hsdp["gradients: fsdp reduce-scatter, hsdp all-reduce"] = (
        2 * (1 / 2) * opt_steps * (na + nc) * r
    )
    for sharding, want in (("fsdp", want_fsdp), ("hsdp", want_hsdp)):
        got = dict(plan.traffic[sharding].items)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == int(want[k]), (sharding, k, got[k], want[k])
    assert plan.traffic["hsdp"].total < plan.traffic["fsdp"].total / 4
    # per-rank memory: FSDP splits over 4 ranks, HSDP over the 2 of a node
    assert plan.inputs.world_size == 4 and plan.inputs.ranks == 4
    assert plan.layout_totals["hsdp"] > plan.layout_totals["fsdp"]
    table = plan.table()
    assert "Across nodes per training step (2 nodes x 2 ranks" in table
    assert "network: parallel.sharding=hsdp sends" in table  # suggested when fsdp spans nodes

    hsdp = plan_from_config(
        load_config("tiny_cpu", ["parallel.sharding=hsdp"]), world_size=2, nnodes=2
    )
    assert hsdp.inputs.world_size == 2 and "parallel.sharding=hsdp sends" not in hsdp.table()
    one = plan_from_config(cfg, world_size=2)
    assert one.traffic == {} and "Across nodes" not in one.table()


def test_plan_command_takes_nnodes(capsys):
    rc = main(
        ["plan", "--formula-only", "--config", "tiny_cpu", "nnodes=2", "nproc_per_node=2",
         "parallel.sharding=hsdp"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "4 ranks = 2 nodes x 2, hsdp: parameters split over 2" in out
    assert "total per node" in out and "this run: parallel.sharding=hsdp" in out
