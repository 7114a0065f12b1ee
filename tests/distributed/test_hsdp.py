"""HSDP on 2 gloo ranks as "2 nodes x 1 rank" (mesh (2, 1)): gradient accumulation with
``set_replica_sync`` crosses the nodes once, and the gradients are the sum over every rank's
micro-batches (the recipe's losses are shares of a global loss: a mean would halve them).

The reference is the same sum computed by one plain model from both ranks' micro-batches, added
in the order HSDP adds them: each rank sums its own two micro-batches, then the all-reduce adds
the two ranks' sums. Each per-micro-batch gradient is one float32 backward of the same weights on
the same rows; if the orders differed, a sum of 4 terms would move by at most 3·u·Σ|terms| (u =
2⁻²⁴), the bound used here. A gradient divided by the ranks (FSDP's default mean) is off by ½.
"""

from __future__ import annotations

from pathlib import Path

import torch

U = torch.finfo(torch.float32).eps / 2


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 51, (2, 8), generator=g) for _ in range(2)]


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).float().pow(2).mean()


def _model(meta: bool):
    from minippo.models import Transformer, init_weights, qwen3_tiny

    with torch.device("meta" if meta else "cpu"):
        model = Transformer(qwen3_tiny(vocab_size=51))
    return model, lambda m: init_weights(m, seed=3)


def _hsdp_rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    import minippo.parallel as parallel

    parallel.init_distributed()
    mesh = parallel.build_mesh("hsdp", world, 1)
    model, init = _model(meta=True)
    parallel.shard_model(model, mesh=mesh, sum_gradients=True)
    model.to_empty(device="cpu")
    init(model)
    assert all(parallel.replicas(p) == 2 for p in model.parameters())
    replicate = mesh.get_group("replicate")
    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is replicate:
            calls.append(tensor.numel())
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    per_micro = []
    try:
        micros = _batches(rank)
        for i, ids in enumerate(micros):
            parallel.set_replica_sync(model, i == len(micros) - 1)
            _loss(model, ids).backward()
            per_micro.append(len(calls))
    finally:
        dist.all_reduce = real
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "calls": per_micro}, Path(out) / "hsdp.pt")
    parallel.destroy_distributed()


def test_hsdp_accumulation_all_reduces_once_and_sums(tmp_path, run_on_ranks):
    run_on_ranks(_hsdp_rank, str(tmp_path))
    got = torch.load(tmp_path / "hsdp.pt")
    model, init = _model(meta=False)
    init(model)
    n_groups = len(model.layers) + 1  # one FSDP group per block, one for the root
    # nothing crosses the "nodes" in the first micro-batch; one all-reduce per group in the last
    assert got["calls"] == [0, n_groups]

    terms = []  # [rank][micro] gradients of the plain model
    for rank in (0, 1):
        row = []
        for ids in _batches(rank):
            model.zero_grad(set_to_none=True)
            _loss(model, ids).backward()
            row.append({n: p.grad.clone() for n, p in model.named_parameters()})
        terms.append(row)
    for name, g in got["grads"].items():
        parts = [terms[r][i][name] for r in (0, 1) for i in (0, 1)]
        want = (parts[0] + parts[1]) + (parts[2] + parts[3])
        bound = 3 * U * sum(p.abs() for p in parts) + 1e-30
        assert bool(((g - want).abs() <= bound).all()), name
        assert float(want.abs().max()) > 0, name
