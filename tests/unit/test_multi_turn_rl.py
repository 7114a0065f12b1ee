"""The training side of multi-turn trajectories: observation tokens (response_mask 0, version
-1, attended to) are skipped by GAE, the policy loss and its token-mean denominator, whitening,
the staleness count and the corrections' anchors; packing computes on them as context."""

from __future__ import annotations

import torch

from minippo import models, rl
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.rl.correction import KeepOldActor, staleness_metrics
from minippo.rl.types import RolloutBatch
from tests.correction_helpers import model_with, perturb, score

V = 64
# two episodes: model v0 | observation | model v1 | observation | model v2, and a shorter one
VERSIONS = [[0, 0, -1, -1, 1, 1, -1, 2], [0, -1, 1, 1, -1, -1, -1, -1]]
ATTENDED = [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]  # row 1: its tail is padding
P = 3


def mt_batch(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(VERSIONS)
    resp_attn = torch.tensor(ATTENDED, dtype=torch.bool)
    prompt_attn = torch.tensor([[True, True, True], [False, True, True]])  # one left pad
    attn = torch.cat([prompt_attn, resp_attn], dim=1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0) * attn.long()
    ids = torch.randint(1, V, attn.shape, generator=g) * attn.long()
    mask = (v >= 0).float()
    mu = torch.where(mask > 0, -torch.rand(v.shape, generator=g) - 0.5, 0.0)
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, position_ids=pos, response_mask=mask,
        rollout_logprobs=mu, versions=v, rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]), truncated=torch.tensor([False, False]),
    )  # fmt: skip


def compact(x: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of a [B, R] tensor at its model tokens only."""
    return x[row][torch.tensor(VERSIONS[row]) >= 0]


def test_gae_skips_an_observation_span_as_if_it_were_absent():
    """Across an observation span the value after a model turn's last token is the critic's
    value before the next model turn (discounted once): GAE over the masked row equals GAE over
    the row with the observation columns removed."""
    b = mt_batch()
    g = torch.Generator().manual_seed(1)
    values = torch.randn(b.response_mask.shape, generator=g)
    values = torch.where(b.response_mask > 0, values, 99.0)  # junk on observations
    rewards = rl.place_sequence_rewards(b.rewards, b.response_mask)
    adv, ret = rl.gae(values, rewards, b.response_mask, gamma=0.9, lam=0.8)
    for row in range(2):
        m = compact(b.response_mask, row)[None]
        a_ref, r_ref = rl.gae(
            compact(values, row)[None], compact(rewards, row)[None], m, gamma=0.9, lam=0.8
        )
        torch.testing.assert_close(compact(adv, row), a_ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(compact(ret, row), r_ref[0], rtol=0, atol=1e-6)
    assert (adv[b.response_mask == 0] == 0).all() and (ret[b.response_mask == 0] == 0).all()
    # the reward sits on the episode's last MODEL token
    assert rewards[0].tolist() == [0] * 7 + [1.0] and rewards[1, 3] == 0.0


def test_observation_positions_get_zero_gradient_and_are_not_counted():
    b = mt_batch()
    model = init_weights(Transformer(qwen3_tiny(V)), seed=0, std=0.5)
    kw = dict(attention_mask=b.attention_mask, position_ids=b.position_ids, start=P)
    lp = models.token_logprobs(model, b.input_ids, **kw)
    lp.retain_grad()
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(b.response_mask.shape, generator=g)
    anchors = lp.detach() + 0.05 * torch.randn(lp.shape, generator=g)
    loss, _ = rl.policy_loss(lp, anchors, adv, b.response_mask, agg_mode="token-mean")
    loss.backward()
    assert (lp.grad[b.response_mask == 0] == 0).all()
    assert (lp.grad[b.response_mask > 0] != 0).all()
    # token-mean over model tokens only: the hand-built batch without the observation columns
    n_model = int(b.response_mask.sum())
    per_token = []
    for row in range(2):
        r = torch.exp(compact(lp.detach(), row) - compact(anchors, row))
        a = compact(adv, row)
        per_token.append(torch.maximum(-r * a, -r.clamp(0.8, 1.2) * a))
    expected = torch.cat(per_token).sum() / n_model
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-7)
    assert n_model == 8  # 5 + 3 model tokens, not the 12 attended response tokens
    # whitening: the statistics are those of the model tokens (observations may hold anything)
    junk = torch.where(b.response_mask > 0, adv, 1e6)
    torch.testing.assert_close(
        rl.masked_whiten(junk, b.response_mask)[b.response_mask > 0],
        rl.masked_whiten(adv, b.response_mask)[b.response_mask > 0],
    )


def test_fused_and_packed_passes_agree_with_the_padded_one_on_a_multi_turn_batch():
    b = mt_batch()
    model = init_weights(Transformer(qwen3_tiny(V)), seed=3, std=0.5)
    kw = dict(attention_mask=b.attention_mask, position_ids=b.position_ids, start=P)
    with torch.no_grad():
        padded = models.token_logprobs(model, b.input_ids, **kw)
        packed = models.token_logprobs(
            model, b.input_ids, **kw, packed=models.pack(b.attention_mask, start=P)
        )
    m = b.response_mask > 0
    torch.testing.assert_close(packed[m], padded[m], rtol=0, atol=1e-5)
    adv = torch.linspace(-1, 1, b.response_mask.numel()).view_as(padded)
    spec = models.FusedLossSpec(
        anchor_logprobs=padded + 0.1, advantages=adv, response_mask=b.response_mask
    )
    fused = models.fused_policy_loss(model, b.input_ids, spec, **kw)
    lp = models.token_logprobs(model, b.input_ids, **kw)
    ref, _ = rl.policy_loss(lp, padded + 0.1, adv, b.response_mask)
    torch.testing.assert_close(fused.loss, ref, rtol=1e-5, atol=1e-6)


def test_staleness_count_and_keep_old_actor_anchors_skip_observations_across_turns():
    """Each model token's anchor is the logprob under the snapshot of the version that sampled
    it (across turns); observations (version -1) reference no snapshot and count no staleness."""
    model = init_weights(Transformer(qwen3_tiny(V)), seed=0, std=0.5)
    corr = KeepOldActor(max_staleness=2)
    saved = []
    for v in range(3):
        saved.append([p.detach().clone() for p in model.parameters()])
        corr.on_weights_published(v, model)
        perturb(model, seed=10 + v)
    b = mt_batch()
    out = corr.prepare(b, model, step=2)
    assert out.metrics()["correction/version_mismatches"] == 0
    refs = [score(model_with(w, vocab=V), b) for w in saved]
    for row in range(2):
        for j, v in enumerate(VERSIONS[row]):
            if v >= 0:
                assert torch.equal(out.anchor_logprobs[row, j], refs[v][row, j]), (row, j)
            else:
                assert out.weights[row, j] == 0
    st = staleness_metrics(b.versions, b.response_mask, 2)
    model_versions = b.versions[b.response_mask > 0].double()
    assert st["correction/staleness_max"] == 2.0
    assert st["correction/staleness_mean"] == float((2 - model_versions).mean())
