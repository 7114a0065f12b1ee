"""The critic under FSDP2 on 2 gloo ranks, as the recipe trains it: its gradients equal the
unsharded critic's, and its forward returns no view (FSDP2 warns that a view output "can cause
backward to fail or produce wrong gradients")."""

import warnings

import torch

from minippo import rl
from minippo.models import ValueModel, init_weights, qwen3_tiny
from minippo.parallel import (
    destroy_distributed,
    init_distributed,
    load_full_state_dict,
    shard_model,
)

B, P, R = 4, 6, 5  # rows, prompt and response columns


def _batch():
    """Rows identical on every rank: tokens, mask, positions, response mask, old values, returns."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 64, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[3, :4] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    response_mask = torch.ones(B, R)
    response_mask[2, 3:] = 0  # a shorter response
    old = torch.randn(B, R, generator=g) * 0.1
    returns = torch.randn(B, R, generator=g)
    return tokens, mask, pos, response_mask, old, returns


def _value_loss(critic, rows, batch, global_tokens):
    """The recipe's critic loss for ``rows``: its share of the token-mean over all rows."""
    tokens, mask, pos, response_mask, old, returns = (t[rows] for t in batch)
    values, _ = rl.split_critic_values(
        critic(tokens, position_ids=pos, attention_mask=mask).float(), response_mask
    )
    loss, _ = rl.value_loss(
        values, old, returns, response_mask, clip_range=0.2, global_tokens=global_tokens
    )
    return loss


def _worker(rank, world):
    init_distributed()
    try:
        args = qwen3_tiny()
        ref = init_weights(ValueModel(args), seed=3)
        with torch.no_grad():  # a non-zero head, so that every parameter gets a gradient
            ref.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        with torch.device("meta"):
            critic = ValueModel(args)
        shard_model(critic, sum_gradients=True)  # as the recipe shards it
        load_full_state_dict(critic, ref.state_dict(), device="cpu")

        batch = _batch()
        n_tokens = float(batch[3].sum())
        _value_loss(ref, slice(0, B), batch, n_tokens).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            half = B // world
            loss = _value_loss(critic, slice(rank * half, (rank + 1) * half), batch, n_tokens)
            loss.backward()
        views = [str(w.message) for w in caught if "view" in str(w.message)]
        assert not views, views

        # Each gradient entry is a float32 sum over the B·(P+R) positions; sharding changes only
        # the order of the sums and adds one reduce-scatter add. A sum of N terms whose partial
        # sums stay within the gradient scale G = max|g| rounds by at most (N − 1)·u·G, so the
        # two evaluations differ by at most 2N·u·G per tensor (the bound of test_fsdp.py).
        u = torch.finfo(torch.float32).eps / 2
        n = B * (P + R)
        pairs = zip(critic.named_parameters(), ref.named_parameters(), strict=True)
        for (name, p), (_, q) in pairs:
            assert p.grad is not None and q.grad is not None, name
            d = (p.grad.full_tensor() - q.grad).abs().max().item()
            assert d <= 2 * n * u * q.grad.abs().max().item(), (name, d)
        assert ref.value_head.weight.grad.abs().max() > 0
    finally:
        destroy_distributed()


def test_critic_gradients_under_fsdp_equal_unsharded_and_no_view_warning(run_on_ranks):
    run_on_ranks(_worker)
