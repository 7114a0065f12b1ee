"""EWMA resets θ̄ when the retained fraction falls strictly below ``reset_below``: a fraction
exactly at the threshold keeps θ̄ (and its anchors), one token fewer resets it."""

import math

import torch

from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.rl.correction import EWMA
from minippo.rl.types import RolloutBatch
from tests.correction_helpers import V, perturb, score


def batch_of(n_rows: int, R: int, lengths: list[int]) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    P = 3
    resp = torch.zeros(n_rows, R)
    for b, n in enumerate(lengths):
        resp[b, :n] = 1.0
    attn = torch.cat([torch.ones(n_rows, P, dtype=torch.bool), resp.bool()], dim=1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    ids = torch.randint(1, V, (n_rows, P + R), generator=g) * attn.long()
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        response_mask=resp,
        rollout_logprobs=torch.zeros(n_rows, R),
        versions=torch.where(resp > 0, 0, -1),
        rewards=torch.zeros(n_rows),
        group_ids=torch.arange(n_rows),
        truncated=torch.zeros(n_rows, dtype=torch.bool),
    )


def prepare_with_masked_tokens(n_masked: int):
    """5 response tokens; μ equals θ̄'s logprob except on ``n_masked`` tokens, where it is
    log 4 lower (ratio 4, outside the mask [1/2, 2]): retained fraction (5 − n_masked) / 5."""
    model = init_weights(Transformer(qwen3_tiny(V)), seed=0, std=0.5)
    corr = EWMA(max_staleness=2, updates_per_step=1, reset_below=0.8, cap=2.0)
    corr.on_weights_published(0, model)  # θ̄ = θ₀
    batch = batch_of(2, 3, [3, 2])
    mask = batch.response_mask
    mu = torch.where(mask > 0, score(model, batch), 0.0)
    off = torch.zeros_like(mask)
    for b, t in [(0, 1), (1, 0), (0, 2)][:n_masked]:
        off[b, t] = math.log(4.0)
    batch.rollout_logprobs = mu - off
    perturb(model, seed=1, scale=1e-3)  # the actor moved a little: θ ≠ θ̄
    corr.after_optimizer_step(model)
    out = corr.prepare(batch, model, step=1)
    return corr, out.metrics()


def test_retained_fraction_exactly_at_reset_below_keeps_theta_bar():
    corr, m = prepare_with_masked_tokens(1)
    # θ̄ after the step is a mix of θ₀ and θ: the anchors moved a little, none crossed the mask
    assert m["correction/ewma_retained_before_reset"] == 0.8 == corr.reset_below
    assert m["correction/ewma_reset_this_step"] == 0.0 and corr.resets == 0
    assert corr.n > 1.0  # θ̄ still averages two weight versions


def test_retained_fraction_below_reset_below_resets_theta_bar():
    corr, m = prepare_with_masked_tokens(2)
    assert m["correction/ewma_retained_before_reset"] == 0.6
    assert m["correction/ewma_reset_this_step"] == 1.0 and corr.resets == 1
    assert corr.n == 1.0 and m["correction/ewma_distance"] == 0.0
