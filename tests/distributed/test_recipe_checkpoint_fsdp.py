"""Checkpointer with FSDP2 on 2 gloo ranks: each rank writes its shards and its extra state; a
fresh sharded model and optimizer loaded from them continue exactly like the originals."""

import torch
import torch.distributed as dist

from minippo.models import Transformer, init_weights, qwen3_tiny, token_logprobs
from minippo.parallel import (
    destroy_distributed,
    gather_full_state_dict,
    init_distributed,
    shard_model,
)
from minippo.training.checkpoint import Checkpointer


def _model(seed):
    model = init_weights(Transformer(qwen3_tiny()), seed=seed)
    shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optim, rank, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)  # each rank its own data
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    (-token_logprobs(model, tokens, start=4).sum()).backward()
    optim.step()
    optim.zero_grad()


class _Rank:
    """A per-rank Stateful: each rank saves and loads its own value."""

    def __init__(self, rank):
        self.rank = rank

    def state_dict(self):
        return {"rank": self.rank}

    def load_state_dict(self, state):
        self.rank = state["rank"]


def _check(rank, world, tmpdir):
    init_distributed()
    try:
        model, optim = _model(0)
        _step(model, optim, rank, 1)
        ckpt = Checkpointer(tmpdir)
        ckpt.save(1, models={"actor": (model, optim)}, states={"rank": _Rank(rank)})
        names = sorted(p.name for p in ckpt.ckpt_dir.iterdir())
        assert names == ["latest", "step_000001"], names
        files = sorted(p.name for p in (ckpt.ckpt_dir / "step_000001").iterdir())
        assert {"extra_rank0.pt", "extra_rank1.pt", "meta.json", ".metadata"} <= set(files)

        fresh, fresh_optim = _model(5)
        loaded = _Rank(-1)
        meta = ckpt.load(
            ckpt.resolve("latest"), models={"actor": (fresh, fresh_optim)}, states={"rank": loaded}
        )
        assert loaded.rank == rank and meta["world_size"] == world
        a, b = gather_full_state_dict(model), gather_full_state_dict(fresh)
        for k in a:
            assert torch.equal(a[k], b[k]), k
        _step(model, optim, rank, 2)
        _step(fresh, fresh_optim, rank, 2)
        a, b = gather_full_state_dict(model), gather_full_state_dict(fresh)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        dist.barrier()
    finally:
        destroy_distributed()


def test_fsdp_checkpoint_round_trip(run_on_ranks, tmp_path):
    run_on_ranks(_check, str(tmp_path))
