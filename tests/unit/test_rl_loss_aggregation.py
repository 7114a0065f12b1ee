import pytest
import torch

from minippo.rl.aggregation import AGGREGATION_MODES, aggregate, global_counts
from minippo.rl.kl import kl_loss
from minippo.rl.losses import policy_loss, value_loss


def _batch(seed=0, B=8, R=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    lengths[0] = 0  # an empty row
    lengths[1] = 1  # a length-1 response
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    loss = torch.randn(B, R, generator=g, dtype=torch.float64)
    loss[mask == 0] = float("nan")  # padding content must never leak
    return loss, mask


def test_aggregate_by_hand():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(aggregate(L, m, "token-mean"), torch.tensor((1 + 2 + 3 + 4) / 4))
    torch.testing.assert_close(
        aggregate(L, m, "seq-mean-token-mean"), torch.tensor(((1 + 2 + 3) / 3 + 4 / 1) / 2)
    )
    torch.testing.assert_close(
        aggregate(L, m, "seq-mean-token-sum"), torch.tensor(((1 + 2 + 3) + 4) / 2)
    )
    assert float(aggregate(L, torch.zeros(2, 3), "token-mean")) == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batched_sum_equals_full_batch(mode):
    loss, mask = _batch()
    param = torch.randn(1, loss.shape[1], dtype=torch.float64, requires_grad=True)

    def per_token(rows):
        # a differentiable per-token loss that depends on a shared parameter
        return torch.where(mask[rows] > 0, loss[rows], 0.0) * param.expand(len(rows), -1) ** 2

    full = aggregate(per_token(torch.arange(8)), mask, mode)
    (full_grad,) = torch.autograd.grad(full, param)

    counts = global_counts(mask)
    total = 0.0
    grad = torch.zeros_like(param)
    for rows in (torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6, 7])):
        part = aggregate(
            per_token(rows),
            mask[rows],
            mode,
            global_tokens=counts.tokens,
            global_seqs=counts.seqs,
        )
        (g,) = torch.autograd.grad(part, param)
        total = total + part.detach()
        grad += g
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(grad, full_grad)
    assert torch.isfinite(full)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_losses_micro_batched_equal_full_batch(mode):
    g = torch.Generator().manual_seed(3)
    B, R = 6, 5
    _, mask = _batch(seed=4, B=B, R=R)
    anchor = torch.randn(B, R, generator=g, dtype=torch.float64)
    logp = (anchor + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    keep = (torch.rand(B, R, generator=g) > 0.2).double()
    values = torch.randn(B, R, generator=g, dtype=torch.float64, requires_grad=True)
    old_values = values.detach() + 0.1
    returns = torch.randn(B, R, generator=g, dtype=torch.float64)

    def total(rows, **counts):
        pl, _ = policy_loss(
            logp[rows],
            anchor[rows],
            adv[rows],
            mask[rows],
            keep_mask=keep[rows],
            agg_mode=mode,
            **counts,
        )
        vl, _ = value_loss(
            values[rows], old_values[rows], returns[rows], mask[rows], agg_mode=mode, **counts
        )
        kl, _ = kl_loss(logp[rows], anchor[rows], mask[rows], agg_mode=mode, **counts)
        return pl + vl + kl

    full = total(torch.arange(B))
    full_grads = torch.autograd.grad(full, (logp, values))
    c = global_counts(mask)
    parts = [
        total(rows, global_tokens=c.tokens, global_seqs=c.seqs)
        for rows in (torch.arange(0, 2), torch.arange(2, 6))
    ]
    summed = parts[0] + parts[1]
    grads = torch.autograd.grad(summed, (logp, values))
    torch.testing.assert_close(summed, full)
    for a, b in zip(grads, full_grads):
        torch.testing.assert_close(a, b)


def test_global_counts_local_and_validation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    c = global_counts(mask)
    assert (c.tokens, c.seqs) == (3.0, 2.0)
    L = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(L, mask, "token-mean", global_tokens=2.0)
    with pytest.raises(ValueError, match="global_seqs"):
        aggregate(L, mask, "seq-mean-token-sum", global_tokens=3.0)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate(L, mask, "mean")
