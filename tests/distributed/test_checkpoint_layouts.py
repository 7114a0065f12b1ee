"""A DCP checkpoint saved on one layout loads on another (docs/multinode.md).

Saved by HSDP over "2 nodes x 1 rank" (mesh (2, 1): every rank holds whole tensors, one replica
per node), then loaded by 2 ranks of one node (mesh (1, 2): each rank holds half of every tensor)
and by one plain process. DCP reads each rank's part of every tensor whatever wrote it, so the
loaded weights and AdamW states are the saved ones bit for bit (a load copies, it computes
nothing). A full resume on the other layout is refused: the per-rank states belong to the saved
shards. The same spawn checks that a folder declared shared but not seen by every rank, or
declared node-local but shared, stops the save with the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minippo.training.checkpoint import Checkpointer

SEED = 0


def _model_and_optimizer(mesh):
    """The tiny Transformer, sharded over ``mesh`` (None: plain), and its AdamW."""
    from minippo.models import Transformer, init_weights, qwen3_tiny
    from minippo.parallel import shard_model

    args = qwen3_tiny(vocab_size=51)
    with torch.device("meta" if mesh is not None else "cpu"):
        model = Transformer(args)
    if mesh is not None:
        shard_model(model, mesh=mesh, sum_gradients=True)
        model.to_empty(device="cpu")
    init_weights(model, seed=SEED + 7)  # another init than the saved weights
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_states(model, optim) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state as full tensors (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optim.{name}.{key}"] = value.detach().clone()
    return out


def _train_and_save(rank: int, world: int, out: str) -> None:
    import minippo.parallel as parallel

    parallel.init_distributed()
    mesh = parallel.build_mesh("hsdp", world, 1)  # 2 "nodes" x 1 rank
    model, optim = _model_and_optimizer(mesh)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(2):
        ids = torch.randint(0, 51, (2, 8), generator=g)
        model(ids).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    ckpt = Checkpointer(Path(out) / "ckpt")
    ckpt.save(2, models={"actor": (model, optim)}, states={})
    full = _full_states(model, optim)
    if rank == 0:
        torch.save(full, Path(out) / "saved.pt")

    # parallel.shared_output_dir=true on folders that are not one (each rank's own "disk")
    Checkpointer.visibility_wait_s = 0.5
    local = Checkpointer(Path(out) / f"disk{rank}")
    with pytest.raises(OSError, match="not one folder shared by every node"):
        local.save(3, models={"actor": (model, optim)}, states={})
    # parallel.shared_output_dir=false on one folder: both ranks lead a "node" (LOCAL_RANK 0)
    os.environ["LOCAL_RANK"] = "0"
    node_local = Checkpointer(Path(out) / "ckpt", shared=False)
    with pytest.raises(OSError, match="one folder shared by several nodes"):
        node_local.save(3, models={"actor": (model, optim)}, states={})
    parallel.destroy_distributed()


def _load_on_one_node(rank: int, world: int, out: str) -> None:
    import minippo.parallel as parallel

    parallel.init_distributed()
    mesh = parallel.build_mesh("hsdp", world, world)  # 1 node x 2 ranks
    model, optim = _model_and_optimizer(mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.to_local().shape[0] * 2 == wq.shape[0]  # each rank holds half
    ckpt = Checkpointer(Path(out) / "ckpt")
    path = ckpt.resolve("latest")
    with pytest.raises(ValueError, match=r"split over 1 ranks, this run splits them over 2"):
        ckpt.load(path, models={"actor": (model, optim)}, states={})
    ckpt.load_models(path, models={"actor": (model, optim)})
    full = _full_states(model, optim)
    if rank == 0:
        torch.save(full, Path(out) / "loaded_1x2.pt")
    parallel.destroy_distributed()


def test_checkpoint_loads_across_layouts(tmp_path, run_on_ranks):
    run_on_ranks(_train_and_save, str(tmp_path))
    saved = torch.load(tmp_path / "saved.pt")
    meta = Checkpointer(tmp_path / "ckpt").verify(tmp_path / "ckpt" / "step_000002")
    assert (meta["world_size"], meta["shard_ranks"]) == (2, 1)

    run_on_ranks(_load_on_one_node, str(tmp_path))
    loaded = torch.load(tmp_path / "loaded_1x2.pt")

    model, optim = _model_and_optimizer(None)  # one process, no process group
    before = _full_states(model, optim)
    Checkpointer(tmp_path / "ckpt").load_models(
        tmp_path / "ckpt" / "step_000002", models={"actor": (model, optim)}
    )
    plain = _full_states(model, optim)

    assert saved.keys() == loaded.keys() == plain.keys()
    assert any(k.endswith("exp_avg_sq") for k in saved)  # the AdamW states are compared too
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
        assert torch.equal(plain[k], saved[k]), k
    moved = [k for k in saved if k.startswith("model.") and not torch.equal(before[k], saved[k])]
    assert len(moved) == sum(k.startswith("model.") for k in saved)  # the load changed them all
