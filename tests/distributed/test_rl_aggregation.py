"""Two gloo processes, each holding half of a batch: the summed contributions and the
DP-averaged gradients equal the full-batch loss and gradient, for every aggregation mode."""

import os

import torch
import torch.distributed as dist

from minippo.rl.aggregation import AGGREGATION_MODES, aggregate, global_counts
from minippo.rl.functional import masked_whiten

WORLD_SIZE = 2


def _data():
    g = torch.Generator().manual_seed(0)
    B, R = 6, 5
    # uneven halves: rank 0 gets short rows, rank 1 long ones, and an empty row
    lengths = torch.tensor([1, 2, 0, 5, 4, 5])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).double()
    loss = torch.randn(B, R, generator=g, dtype=torch.float64)
    param = torch.randn(R, generator=g, dtype=torch.float64)
    return loss, mask, param


def _per_token(loss, param):
    return loss * torch.tanh(param)[None, :] * 3.0


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        loss, mask, param0 = _data()
        rows = slice(0, 3) if rank == 0 else slice(3, 6)
        counts = global_counts(mask[rows])  # all-reduced over both ranks
        results = {"counts": (counts.tokens, counts.seqs)}
        # advantage whitening with the statistics of both ranks (nan on padding must not leak)
        padded = torch.where(mask[rows] > 0, loss[rows], torch.full_like(loss[rows], float("nan")))
        results["whitened"] = masked_whiten(padded, mask[rows])
        for mode in AGGREGATION_MODES:
            param = param0.clone().requires_grad_()
            total = torch.zeros((), dtype=torch.float64)
            # two micro-batches of this rank's half, one backward each (gradient accumulation)
            for micro in (slice(0, 1), slice(1, 3)):
                local_loss = loss[rows][micro]
                local_mask = mask[rows][micro]
                part = aggregate(
                    _per_token(local_loss, param),
                    local_mask,
                    mode,
                    global_tokens=counts.tokens,
                    global_seqs=counts.seqs,
                )
                # DP grad averaging divides by world_size: scale the backward loss by it
                (part * dist.get_world_size()).backward()
                total += part.detach()
            # what FSDP/DDP do to gradients: average over ranks
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            # the logged value: the sum of contributions over ranks is the full-batch loss
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            results[mode] = (total.item(), param.grad.clone())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_rank_aggregation_equals_full_batch(tmp_path, run_on_ranks):
    run_on_ranks(_worker, str(tmp_path), world_size=WORLD_SIZE)
    loss, mask, param0 = _data()
    for rank in range(WORLD_SIZE):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["counts"] == (float(mask.sum()), 5.0)
        rows = slice(0, 3) if rank == 0 else slice(3, 6)
        full = masked_whiten(loss, mask)  # one process: the whole batch's statistics
        torch.testing.assert_close(results["whitened"], full[rows], rtol=1e-12, atol=1e-12)
        for mode in AGGREGATION_MODES:
            param = param0.clone().requires_grad_()
            full = aggregate(_per_token(loss, param), mask, mode)
            (full_grad,) = torch.autograd.grad(full, param)
            value, grad = results[mode]
            assert abs(value - full.item()) < 1e-12, (mode, value, full.item())
            torch.testing.assert_close(grad, full_grad)
