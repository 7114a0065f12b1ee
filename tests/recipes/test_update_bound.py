"""``ppo.max_update_kl`` in the recipe: an actor step that moves its own minibatch's tokens by more
than the bound however far it is shortened is undone (the actor and its optimizer state as before
the step, bit for bit; the critic's step stays), also on 2 FSDP2 ranks (sharded parameters and
states); a bound never reached changes nothing; ``train/update_kl``, ``train/updates_shortened``
and ``train/updates_undone`` are logged. In the GPU configs' precision (``dtype: bf16``: FSDP2
with bf16 compute and fp32 master weights) the undo restores the fp32 masters, and a step that
moves nothing measures a KL of exactly 0 (no rounding floor under the bound). Driven with fixed rollouts, AdamW (its moments
and step counter must come back too)."""

from __future__ import annotations

import torch

from minippo.config import load_config
from minippo.training.metrics import read_jsonl
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
    run_on_ranks,
    shared_process_group,
)

ADAM_TWO_STEPS = [
    "total_steps=2",
    "ppo.minibatches=2",  # 2 actor steps per training step
    "ppo.micro_batch_size=null",  # a minibatch in one forward (2 rows per rank on 2 ranks)
    "optimizer._component_=minippo.training.optimizers.AdamW",
    "optimizer.lr=3e-3",
]


def _train(tmp_path, name: str, max_update_kl: str, rank: int = 0, world: int = 1, extra=()):
    overrides = [
        *FIXED_BATCH_OVERRIDES, *ADAM_TWO_STEPS, f"ppo.max_update_kl={max_update_kl}", *extra
    ]  # fmt: skip
    cfg = load_config("tiny_cpu", [*overrides, f"output_dir={tmp_path / name}"])
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)

        def state():  # on 2 ranks: this rank's shards
            tensors = {}
            for name, model in (("actor", recipe.actor), ("critic", recipe.critic)):
                for k, v in model.state_dict().items():
                    tensors[f"{name}.{k}"] = getattr(v, "_local_tensor", v).detach().clone()
            for i, st in enumerate(recipe.optimizer.state.values()):
                for k, v in st.items():
                    v = getattr(v, "_local_tensor", v)
                    tensors[f"adam{i}.{k}"] = torch.as_tensor(v).clone()
            return tensors

        before = state()
        recipe.train()
        after = state()
    return before, after, read_jsonl(tmp_path / name / "metrics.jsonl")


def _same(a: dict, b: dict, prefix: str) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


def test_every_step_beyond_the_bound_is_undone_and_only_the_actor_is_restored(tmp_path):
    before, after, rows = _train(tmp_path, "undo_all", "1e-30")  # any real step exceeds it
    assert _same(before, after, "actor.") and _same(before, after, "adam")
    assert not _same(before, after, "critic.")  # the critic trains on
    assert [r["train/updates_undone"] for r in rows] == [2.0, 2.0]
    assert [r["train/updates_shortened"] for r in rows] == [0.0, 0.0]
    assert all(r["train/update_kl"] > 1e-30 for r in rows)


def test_a_bound_never_reached_changes_nothing(tmp_path):
    _, guarded, rows = _train(tmp_path, "far", "1e30")
    _, plain, plain_rows = _train(tmp_path, "off", "null")
    assert guarded.keys() == plain.keys()
    assert all(torch.equal(guarded[k], plain[k]) for k in plain)
    assert [r["train/updates_undone"] for r in rows] == [0.0, 0.0]
    assert [r["train/updates_shortened"] for r in rows] == [0.0, 0.0]
    assert all(0 < r["train/update_kl"] < 1 for r in rows)
    assert all("train/update_kl" not in r for r in plain_rows)
    for r, p in zip(rows, plain_rows, strict=True):
        assert r["train/loss"] == p["train/loss"] and r["train/grad_norm"] == p["train/grad_norm"]


def _two_ranks(rank: int, world: int, out: str) -> None:
    from pathlib import Path

    before, after, _ = _train(Path(out), "two_ranks", "1e-30", rank, world)
    assert _same(before, after, "actor.") and _same(before, after, "adam"), rank
    assert not _same(before, after, "critic."), rank


def test_an_undone_step_restores_the_sharded_actor_on_two_ranks(tmp_path):
    run_on_ranks(_two_ranks, str(tmp_path))
    rows = read_jsonl(tmp_path / "two_ranks" / "metrics.jsonl")
    assert [r["train/updates_undone"] for r in rows] == [2.0, 2.0]


def _bf16(rank: int, world: int, out: str) -> None:
    """dtype=bf16 needs a process group (FSDP2 mixed precision): one spawned rank, two runs."""
    from pathlib import Path

    with shared_process_group():
        before, after, _ = _train(Path(out), "bf16_undo", "1e-30", rank, world, ["dtype=bf16"])
        assert _same(before, after, "actor.") and _same(before, after, "adam")
        assert not _same(before, after, "critic.")
        assert all(v.dtype == torch.float32 for k, v in after.items() if k.startswith("actor."))
        still = ["dtype=bf16", "optimizer.lr=1e-30"]  # below every weight's last bit: no move
        before, after, _ = _train(Path(out), "bf16_still", "1e30", rank, world, still)
        assert _same(before, after, "actor.")


def test_in_bf16_the_undo_restores_the_fp32_masters_and_a_still_step_measures_zero(tmp_path):
    """The bound in the GPU configs' precision. An undone step leaves the fp32 master weights and
    AdamW's state as they were. A step that moves no weight measures an update KL of exactly 0:
    the "before" logprobs (the fused loss's pass) and the re-score are the same bf16 operations on
    the same rows with the same shapes, so they agree bit for bit (as the on-policy ratio of 1 in
    tests/distributed/test_bf16_recipe.py); a rounding floor would eat into the bound."""
    run_on_ranks(_bf16, str(tmp_path), world_size=1)
    undone = read_jsonl(tmp_path / "bf16_undo" / "metrics.jsonl")
    assert [r["train/updates_undone"] for r in undone] == [2.0, 2.0]
    still = read_jsonl(tmp_path / "bf16_still" / "metrics.jsonl")
    assert [r["train/update_kl"] for r in still] == [0.0, 0.0]
    assert [r["train/updates_undone"] + r["train/updates_shortened"] for r in still] == [0, 0]
