"""The fused lm_head + policy loss (minippo.models.fused_policy_loss) against the unfused path:
``token_logprobs_and_entropy`` then ``rl.policy_loss`` (+ β·``rl.kl_loss``), backward.

Both paths compute the same quantities with the same float operations, grouped differently (the
fused path applies the chain rule per token in closed form). The logprobs are float32 on both
sides (the lm_head output is upcast), so the gradient with respect to the logits ``dz`` of each
path rounds in float32: an entry differs by at most 4u·|dz| (u = 2⁻²⁴; the token gradient, the
softmax, the product and the division by T each round once). The model's backward is linear in
``dz`` and runs in float64 here (its own rounding is ~10⁹ times smaller), and a gradient entry
sums at most V such terms of a logit row within the scale G = max|g| of its tensor, so the two
gradients differ by at most 4·V·u·G (observed: ≤ 9·u·G). A mistake in the chain rule moves a
gradient by O(G), ~10⁴ times the bound. For the direct hidden/lm_head test in float32 and
bfloat16 an entry is a sum of n = max(V, N) products (a row of dz @ W sums V, dzᵀ @ h sums N);
regrouping such a sum changes it by at most 2n·u·G.
"""

from __future__ import annotations

import copy
import itertools
from functools import partial

import pytest
import torch

from minippo import rl
from minippo.models import (
    FusedLossSpec,
    Transformer,
    fused_policy_loss,
    init_weights,
    qwen3_tiny,
    token_logprobs_and_entropy,
)
from minippo.models.fused_policy_loss import fused_policy_loss_from_hidden
from minippo.models.logprobs import logprobs_from_hidden
from minippo.parallel import apply_activation_checkpointing
from minippo.parallel.activation_checkpointing import is_activation_checkpointed
from minippo.rl.correction import CurrentAnchors, ProximalAnchors, truncated_is_weights
from tests.helpers import fixed_rollout_batch

AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL = (None, "k2", "k3")


def _inputs(batch, lp: torch.Tensor, seed: int = 1) -> dict:
    """Anchors around the current logprobs (both clip sides and the dual clip bind), signed
    advantages, weights, a keep-mask rejecting some tokens, reference logprobs; non-finite values
    on padding (they must not reach anything)."""
    g = torch.Generator().manual_seed(seed)
    m = batch.response_mask
    B, R = m.shape
    pad = m == 0
    anchor = (lp + 0.4 * torch.randn(B, R, generator=g, dtype=torch.float64).to(lp.dtype)).detach()
    adv = torch.randn(B, R, generator=g, dtype=torch.float64).to(lp.dtype)
    weights = (0.5 + torch.rand(B, R, generator=g, dtype=torch.float64)).to(lp.dtype)
    keep = (torch.rand(B, R, generator=g) > 0.2).float()
    ref = (lp + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64).to(lp.dtype)).detach()
    nan = torch.tensor(float("nan"), dtype=lp.dtype)
    return {
        "anchor": torch.where(pad, nan, anchor),
        "adv": torch.where(pad, nan, adv),
        "weights": torch.where(pad, nan, weights),
        "keep": keep,
        "ref": torch.where(pad, nan, ref),
        "mask": m.to(lp.dtype),
        "tokens": m.sum(),
        "seqs": (m.sum(-1) > 0).sum().float() + 3,  # global counts larger than the local ones
    }


def _spec(x: dict, agg: str, dual_clip, kl, entropy_coef: float = 0.0) -> FusedLossSpec:
    return FusedLossSpec(
        anchor_logprobs=x["anchor"],
        advantages=x["adv"],
        response_mask=x["mask"],
        weights=x["weights"],
        keep_mask=x["keep"],
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=dual_clip,
        agg_mode=agg,
        global_tokens=x["tokens"] + 5,
        global_seqs=x["seqs"],
        ref_logprobs=None if kl is None else x["ref"],
        kl_estimator=kl or "k3",
        kl_coef=0.3,
        entropy_coef=entropy_coef,
    )


def _unfused(logp: torch.Tensor, spec: FusedLossSpec, entropy: torch.Tensor | None = None):
    agg = dict(
        agg_mode=spec.agg_mode, global_tokens=spec.global_tokens, global_seqs=spec.global_seqs
    )
    loss, st = rl.policy_loss(
        logp,
        spec.anchor_logprobs,
        spec.advantages,
        spec.response_mask,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        dual_clip=spec.dual_clip,
        weights=spec.weights,
        keep_mask=spec.keep_mask,
        **agg,
    )
    kst = None
    if spec.ref_logprobs is not None:
        kl, kst = rl.kl_loss(logp, spec.ref_logprobs, spec.response_mask, spec.kl_estimator, **agg)
        loss = loss + spec.kl_coef * kl
    if spec.entropy_coef:
        ent = rl.aggregate(
            entropy,
            spec.response_mask,
            spec.agg_mode,
            global_tokens=spec.global_tokens,
            global_seqs=spec.global_seqs,
        )
        loss = loss - spec.entropy_coef * ent
    return loss, st, kst


@pytest.fixture(scope="module")
def setup():
    args = qwen3_tiny()
    batch = fixed_rollout_batch(args)
    model = init_weights(Transformer(args), seed=0).double()
    kw = dict(attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(model, batch.input_ids, start=batch.prompt_len, **kw)
    return model, batch, kw, _inputs(batch, lp)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _covering_cases() -> list[tuple]:
    """Every aggregation mode with every KL setting (9 cases), dual clip and temperature
    alternating over them so that each value of each option meets every other option's values:
    every pair of options is covered without the full product (36 cases); the full product runs
    with ``pytest -m slow``."""
    cases = []
    for i, (agg, kl) in enumerate(itertools.product(AGG, KL)):
        cases.append((agg, (None, 1.3)[i % 2], kl, (1.0, 0.7)[(i // 2) % 2]))
    return cases


_ALL = list(itertools.product(AGG, (None, 1.3), KL, (1.0, 0.7)))
_CASES = [c if c in _covering_cases() else pytest.param(*c, marks=pytest.mark.slow) for c in _ALL]


@pytest.mark.parametrize("agg,dual_clip,kl,temperature", _CASES)
def test_model_gradients_equal_unfused(setup, agg, dual_clip, kl, temperature):
    _check_equals_unfused(setup, _spec(setup[3], agg, dual_clip, kl), temperature)


@pytest.mark.parametrize("agg", AGG)
def test_entropy_bonus_gradients_equal_unfused(setup, agg):
    """``entropy_coef`` η: the loss − η·aggregate(entropy), its gradient through every logit
    (entropy with autograd on the unfused side); the term changes the gradients it is compared
    on, so a fused pass that ignored it would fail."""
    x = setup[3]
    grads = _check_equals_unfused(setup, _spec(x, agg, 1.3, "k3", entropy_coef=0.5), 0.7)
    plain = _check_equals_unfused(setup, _spec(x, agg, 1.3, "k3"), 0.7)
    for name, g in grads.items():
        assert (g - plain[name]).abs().max() > 1e-3 * g.abs().max(), name


def _check_equals_unfused(setup, spec: FusedLossSpec, temperature: float) -> dict:
    """The fused pass against the unfused loss with autograd: loss, logprobs, entropy, statistics
    and every parameter's gradient, each within its rounding bound; returns the fused gradients."""
    model, batch, kw, _ = setup
    score = dict(start=batch.prompt_len, temperature=temperature, chunk_size=7, **kw)
    lp, ent = token_logprobs_and_entropy(
        model, batch.input_ids, entropy_grad=spec.entropy_coef != 0.0, **score
    )
    loss, st, kst = _unfused(lp, spec, ent)
    loss.backward()
    ref_grads = _grads(model)

    out = fused_policy_loss(model, batch.input_ids, spec, **score)
    out.loss.backward()
    grads = _grads(model)

    u, V = torch.finfo(torch.float32).eps / 2, model.args.vocab_size
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(out.logprobs, lp.detach(), rtol=0, atol=0)
    # the entropy's row dot Σ p·z sums V float32 products in another order: ≤ 2V·u·max|z|
    with torch.no_grad():
        z_max = model(batch.input_ids, **kw).abs().max() / temperature
    bound = 2 * V * u * z_max
    assert (out.entropy - ent.detach()).abs().max() <= bound
    for field in st._fields:
        torch.testing.assert_close(getattr(out.stats, field), getattr(st, field), rtol=0, atol=0)
    assert (out.kl_stats is None) == (kst is None)
    if kst is not None:
        torch.testing.assert_close(out.kl_stats.kl_mean, kst.kl_mean, rtol=0, atol=0)
    live = 0
    for name, g_ref in ref_grads.items():
        G = g_ref.abs().max()
        assert torch.isfinite(grads[name]).all(), name
        bound = 4 * V * u * G
        err = (grads[name] - g_ref).abs().max()
        assert err <= bound, f"{name}: |fused - unfused| {err:.3g} > {bound:.3g}"
        live += int(G > 1e-6)
    assert live == len(ref_grads)  # every parameter receives a gradient: nothing compared is 0
    return grads


def test_clip_sides_bind(setup):
    """The inputs exercise what the gradient formula distinguishes: both clip sides, the dual
    clip, rejected tokens (otherwise the comparison above would not cover them)."""
    model, batch, kw, x = setup
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(model, batch.input_ids, start=batch.prompt_len, **kw)
    _, st, _ = _unfused(lp, _spec(x, "token-mean", 1.3, None))
    for f in ("clip_frac_low", "clip_frac_high", "dual_clip_frac"):
        assert float(getattr(st, f)) > 0, f
    assert 0 < float(st.kept_frac) < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_and_lm_head_gradients(dtype):
    """The fused function on hidden states and an lm_head weight directly, in the training
    dtypes, against the checkpointed chunks of ``logprobs_from_hidden`` + the unfused loss."""
    g = torch.Generator().manual_seed(0)
    B, R, D, V = 3, 9, 16, 50
    h0 = torch.randn(B, R, D, generator=g).to(dtype)
    w0 = (0.5 * torch.randn(V, D, generator=g)).to(dtype)
    y = torch.randint(0, V, (B, R), generator=g)
    mask = torch.ones(B, R)
    mask[0, 6:] = 0
    mask[2, 2:] = 0
    head = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(w0)
        lp0 = logprobs_from_hidden(h0, head, y, temperature=0.8).float()

    class _B:
        response_mask = mask

    x = _inputs(_B, lp0)
    spec = _spec(x, "seq-mean-token-mean", 1.3, "k3")

    h = h0.clone().requires_grad_(True)
    lp = logprobs_from_hidden(h, head, y, temperature=0.8, chunk_size=4)
    loss, _, _ = _unfused(lp, spec)
    loss.backward()
    gh_ref, gw_ref = h.grad, head.weight.grad

    h2 = h0.clone().requires_grad_(True)
    w2 = w0.clone().requires_grad_(True)
    out = fused_policy_loss_from_hidden(h2, w2, y, spec, temperature=0.8, chunk_size=4)
    (2.0 * out.loss).backward()  # backward scales by the incoming gradient
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-6)
    u = torch.finfo(dtype).eps / 2
    n = max(V, B * R)
    for got, want in ((h2.grad, gh_ref), (w2.grad, gw_ref)):
        want = 2.0 * want.float()
        # bf16: the chunk's gradient dz is rounded to bf16 on both sides (same values); the
        # matmuls then round their sums, float32 accumulation for the lm_head here
        bound = 2 * n * u * want.abs().max()
        assert (got.float() - want).abs().max() <= bound


@pytest.mark.parametrize("which", ["tis", "loglinear_prox"])
def test_token_anchors_equal_the_unfused_minibatch(setup, which):
    """Anchors that follow the policy (``tis`` with one update per step: a = sg(lp); and
    ``loglinear_prox``), formed chunk by chunk inside the fused pass, against the unfused path:
    the training forward's logprobs, ``out.minibatch(rows, lp)``, ``rl.policy_loss``. Chunks of 7
    tokens straddle rows. Same bound as above."""
    model, batch, kw, x = setup
    m = batch.response_mask
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lp0, _ = token_logprobs_and_entropy(model, batch.input_ids, start=batch.prompt_len, **kw)
    mu = torch.where(m > 0, lp0 + 0.3 * torch.randn(m.shape, generator=g), 0.0)
    if which == "tis":
        fn = partial(truncated_is_weights, level="token", mode="mask", low=0.8, cap=1.25)
        corr = CurrentAnchors(mu, m, fn, tokenwise=True, bound_kind="masked")
    else:
        corr = ProximalAnchors(torch.rand(m.shape, generator=g), mu, m, 1.25)
    rows = torch.arange(m.shape[0])
    base = dict(advantages=x["adv"], response_mask=x["mask"], eps_low=0.2, eps_high=0.28)
    base |= dict(dual_clip=1.3, agg_mode="seq-mean-token-mean", global_seqs=x["seqs"])
    score = dict(start=batch.prompt_len, chunk_size=7, **kw)

    lp, _ = token_logprobs_and_entropy(model, batch.input_ids, **score)
    c = corr.minibatch(rows, lp)
    assert 0 < float(c.keep_mask.sum()) < float(m.sum()) or which != "tis"  # the mask binds
    assert (c.weights[m > 0] != 1).any()
    ref_spec = FusedLossSpec(c.anchor_logprobs, weights=c.weights, keep_mask=c.keep_mask, **base)
    loss, st, _ = _unfused(lp, ref_spec)
    loss.backward()
    ref_grads = _grads(model)

    spec = FusedLossSpec(None, token_anchors=corr.token_anchors(rows), **base)
    out = fused_policy_loss(model, batch.input_ids, spec, **score)
    out.loss.backward()
    grads = _grads(model)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    for field in st._fields:
        torch.testing.assert_close(getattr(out.stats, field), getattr(st, field), rtol=0, atol=0)
    u, V = torch.finfo(torch.float32).eps / 2, model.args.vocab_size
    for name, g_ref in ref_grads.items():
        bound = 4 * V * u * g_ref.abs().max()
        assert (grads[name] - g_ref).abs().max() <= bound, name
    with pytest.raises(ValueError, match="token_anchors replaces"):
        bad = FusedLossSpec(x["anchor"], token_anchors=corr.token_anchors(rows), **base)
        fused_policy_loss(model, batch.input_ids, bad, **score)


def test_no_grad_returns_values_only(setup):
    model, batch, kw, x = setup
    spec = _spec(x, "token-mean", None, "k2")
    with torch.no_grad():
        out = fused_policy_loss(model, batch.input_ids, spec, start=batch.prompt_len, **kw)
        lp, _ = token_logprobs_and_entropy(model, batch.input_ids, start=batch.prompt_len, **kw)
    loss, _, _ = _unfused(lp, spec)
    assert not out.loss.requires_grad
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12)


def test_bad_shapes_name_the_input(setup):
    model, batch, kw, x = setup
    spec = _spec(x, "token-mean", None, None)
    bad = FusedLossSpec(**{**spec.__dict__, "advantages": x["adv"][:, :-1]})
    with pytest.raises(ValueError, match="advantages has shape"):
        fused_policy_loss(model, batch.input_ids, bad, start=batch.prompt_len, **kw)
    bad = FusedLossSpec(**{**spec.__dict__, "kl_estimator": "k9"})
    with pytest.raises(ValueError, match="unknown KL estimator"):
        fused_policy_loss(model, batch.input_ids, bad, start=batch.prompt_len, **kw)


def test_activation_checkpointing_changes_nothing(setup):
    """The fused loss (the recipe's update) with ``activation_checkpointing: true`` (the pair that
    meets both the speed and the memory goal, docs/benchmarks.md): each block's forward is
    recomputed by the same ops on the same inputs, so the loss and every gradient are the same to
    the bit."""
    model, batch, kw, x = setup
    spec = _spec(x, AGG[0], None, KL[-1])
    score = dict(start=batch.prompt_len, chunk_size=7, **kw)
    out = fused_policy_loss(model, batch.input_ids, spec, **score)
    out.loss.backward()
    ref = _grads(model)
    ac = apply_activation_checkpointing(copy.deepcopy(model))
    assert all(is_activation_checkpointed(block) for block in ac.layers)
    out_ac = fused_policy_loss(ac, batch.input_ids, spec, **score)
    out_ac.loss.backward()
    grads = _grads(ac)
    assert out_ac.loss.item() == out.loss.item()
    assert set(grads) == set(ref)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
