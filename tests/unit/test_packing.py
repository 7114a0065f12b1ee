"""Packed sequences (minippo.models.packing): the layout, attention inside each sequence, and the
packed model passes against the padded ones (logits, logprobs, entropies, values, gradients, the
fused policy loss), in float64, float32 and bfloat16.

Tolerances. Both passes compute the same per-token arithmetic; what differs is the grouping of
the reductions (matrix products over other row counts, the attention's sums over S padded keys or
Lᵢ real ones, a masked key adding an exact 0). A float sum of n terms regrouped moves by at most
n·u·Σ|terms| (u: the unit roundoff); along one token's path from the embedding to the logits the
reductions have lengths (per block) D (RMSNorm), D (q/k/v), hd (q/k norm), hd (scores),
S (softmax sum), S (probabilities × values), H·hd (output projection), D (RMSNorm), D (gate/up),
I (down), then D (final norm) and D (lm_head): their sum K (:func:`chain_length`). With weights
of std 0.2 no layer amplifies a relative error by more than a few units, and each path is within
K·u·scale of the exact value, so the two differ by at most 2·K·u·scale (scale: the largest
magnitude of the compared output). In bfloat16 every op's output rounds to 8 bits (u = 2⁻⁸)
whatever its length: about 16 roundings per block (:func:`BF16_ROUNDINGS_PER_BLOCK`), so
2·(16·L + 3)·u_bf16·scale. Where the model runs in float64 the logprobs are still float32 (the
lm_head output is upcast to float32 before the softmax): a logit that rounds to float32 on the
other side of a half-ulp moves the logprob by ≤ 2u₃₂·max|z|. A real mistake (a token seeing
another sequence, a position that does not restart) moves an output by O(scale).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from minippo.models import (
    FusedLossSpec,
    Transformer,
    ValueModel,
    fused_policy_loss,
    init_weights,
    pack,
    packing,
    qwen3_tiny,
    token_logprobs,
    token_logprobs_and_entropy,
)
from minippo.models.model import _rope_tables, masked_attention, rope_cos_sin, rope_inv_freq
from minippo.models.packing import bucketed_attention, uses_varlen_kernel, varlen_attention

U32 = torch.finfo(torch.float32).eps / 2  # 2⁻²⁴
U64 = torch.finfo(torch.float64).eps / 2  # 2⁻⁵³
U16 = torch.finfo(torch.bfloat16).eps / 2  # 2⁻⁸
UNIT = {torch.float64: U64, torch.float32: U32, torch.bfloat16: U16}
BF16_ROUNDINGS_PER_BLOCK = 16  # norm, q, k, v, q/k norms, 2 RoPE ops, SDPA, wo, add, norm, gate,
#                               silu, up, product, down, add: every output rounded to bfloat16

# prompt and response lengths; P = 6, R = 7: rows of 13, 5, 4 (no response), 6, 8, 10 tokens, so
# that the attention buckets (longest first, within a factor √2) are [13, 10], [8, 6], [5, 4]
PROMPTS, RESPONSES, P, R = [6, 2, 4, 1, 6, 3], [7, 3, 0, 5, 2, 7], 6, 7


def rollout_like(vocab: int, seed: int = 0):
    """tokens [B, P + R] (left-padded prompt | right-padded response), attention mask, positions."""
    g = torch.Generator().manual_seed(seed)
    B = len(PROMPTS)
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        mask[b, P - p : P + r] = True
    tokens = torch.randint(1, vocab, (B, P + R), generator=g).masked_fill(~mask, 0)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask
    return tokens, mask, pos


def chain_length(args, S: int) -> int:
    """K: the summed reduction lengths along one token's path (the module docstring)."""
    D, hd, H = args.dim, args.head_dim, args.n_heads
    block = 2 * D + 2 * hd + 2 * S + H * hd + 2 * D + args.intermediate_size
    return args.n_layers * block + 2 * D


def bound(args, dtype: torch.dtype, scale: float, S: int = P + R) -> float:
    """The largest difference of two passes over the same arithmetic (module docstring)."""
    if dtype == torch.bfloat16:
        return 2 * (BF16_ROUNDINGS_PER_BLOCK * args.n_layers + 3) * U16 * scale
    return 2 * chain_length(args, S) * UNIT[dtype] * scale


def model_of(dtype: torch.dtype, critic: bool = False):
    args = qwen3_tiny()
    model = ValueModel(args) if critic else Transformer(args)
    model = init_weights(model, seed=3, std=0.2)
    if critic:
        with torch.no_grad():
            model.value_head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
    return model.to(dtype)


# ----------------------------------------------------------------------------------------------
# The layout


def test_layout_by_hand():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    lay = pack(mask, start=3)
    assert lay.shape == (3, 5) and lay.seq_lens == (3, 5, 4) and lay.max_seqlen == 5
    assert lay.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert lay.cols.tolist() == [1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert lay.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert lay.cu_seqlens.tolist() == [0, 3, 8, 12] and lay.cu_seqlens.dtype == torch.int32
    # scored: the real tokens at columns >= 3: (0, 3), (1, 3), (1, 4), (2, 3), at stream
    # indices 2, 6, 7, 11; each predicted by the stream token before it
    assert lay.score_rows.tolist() == [0, 1, 1, 2] and lay.score_cols.tolist() == [0, 0, 1, 0]
    assert lay.score_src.tolist() == [1, 5, 6, 10]
    assert lay.scored_flat_index().tolist() == [0, 2, 3, 4]
    # buckets, longest first: [5, 4] (4·√2 >= 5), then [3] (3·√2 < 5); sequence j of a bucket
    # at slots j·length + position
    (a, b) = lay.buckets
    assert (a.count, a.length) == (2, 5) and (b.count, b.length) == (1, 3)
    assert a.tokens.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert a.slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert b.tokens.tolist() == b.slots.tolist() == [0, 1, 2]
    assert lay.bucket_order.tolist() == [9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    x = torch.arange(15.0).view(3, 5)
    assert torch.equal(lay.scatter(lay.gather(x)), x * mask)
    assert lay.scatter_scored(torch.tensor([1.0, 2, 3, 4])).tolist() == [[1, 0], [2, 3], [4, 0]]


@pytest.mark.parametrize(
    "mask,start,match",
    [
        ([[1, 1, 0], [0, 0, 0]], None, "no real token"),
        ([[1, 0, 1]], None, "padding between real tokens"),
        ([[0, 0, 1, 1]], 2, "before column start=2"),
        ([[1, 1]], 2, "start"),
    ],
)
def test_bad_masks_are_refused(mask, start, match):
    with pytest.raises(ValueError, match=match):
        pack(torch.tensor(mask, dtype=torch.bool), start=start)


# ----------------------------------------------------------------------------------------------
# Attention over the stream, against attention written out


def attention_by_hand(q, k, v, allowed) -> torch.Tensor:
    """softmax(q·kᵀ/√hd over the allowed keys)·v in float64; q [B, H, S, hd], k/v
    [B, H_kv, S_kv, hd], allowed Bool[B, S, S_kv]; query head h reads key/value head
    h // (H / H_kv)."""
    B, H, S, hd = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, S, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // group
            scores = q[b, h].double() @ k[b, kv].double().T / math.sqrt(hd)
            scores = scores.masked_fill(~allowed[b], float("-inf"))
            out[b, h] = scores.softmax(-1) @ v[b, kv].double()
    return out


def attention_bound(q, k, v, keys: int) -> float:
    """float32 attention against float64: a score sums hd products, so it is off by at most
    hd·u·s with s = hd·max|q|·max|k|/√hd (a bound on Σ|q_i·k_i|/√hd); that moves a probability
    by a relative 2·hd·u·s; the softmax's normaliser and the weighted sum of the values add
    (keys + 2)·u each: |Δout| ≤ (2·hd·u·s + 2·(keys + 2)·u)·max|v|."""
    hd = q.shape[-1]
    s = hd * float(q.abs().max()) * float(k.abs().max()) / math.sqrt(hd)
    return (2 * hd * U32 * s + 2 * (keys + 2) * U32) * float(v.abs().max())


def stream_qkv(seed: int = 0, H: int = 4, Hkv: int = 2, hd: int = 8):
    """q [N, H, hd] and k, v [N, H_kv, hd] of the stream of :func:`rollout_like`'s rows, each
    head with its own scale (a head read from the wrong key/value head shows)."""
    _, mask, _ = rollout_like(64)
    lay = pack(mask, start=P)
    g = torch.Generator().manual_seed(seed)
    N = lay.num_tokens
    head_scale = torch.arange(1, H + 1, dtype=torch.float32)[None, :, None]
    q = torch.randn(N, H, hd, generator=g) * head_scale
    k = torch.randn(N, Hkv, hd, generator=g) * head_scale[:, :Hkv]
    v = torch.randn(N, Hkv, hd, generator=g) + torch.arange(Hkv)[None, :, None] * 3
    return lay, q, k, v


def causal_by_hand(q, k, v, lay) -> torch.Tensor:
    """Each sequence of the stream attended alone, causally, by :func:`attention_by_hand`."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, e in itertools.pairwise(lay.cu_seqlens.tolist()):
        L = e - s
        allowed = torch.ones(1, L, L, dtype=torch.bool).tril()
        one = attention_by_hand(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), allowed)
        out[s:e] = one[0].transpose(0, 1)
    return out


def test_bucketed_attention_keeps_every_sequence_to_itself():
    lay, q, k, v = stream_qkv()
    assert len(lay.buckets) == 3  # [13, 10], [8, 6], [5, 4]: padding inside two of them
    got = bucketed_attention(q, k, v, lay)
    want = causal_by_hand(q, k, v, lay)
    err = (got.double() - want).abs().max().item()
    assert err <= attention_bound(q, k, v, lay.max_seqlen), err


def test_packed_attention_layer_equals_the_formula_written_out():
    """The model's Attention on a packed stream of two sequences equals the hand computation of
    each sequence alone (projections, q/k norm, RoPE from position 0 in each, GQA)."""
    from tests.unit.test_models_native_truths import attention_by_hand as layer_by_hand

    args = qwen3_tiny()
    attn = init_weights(Transformer(args), seed=3, std=0.2).layers[0].attention
    lengths = [6, 4]
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    lay = pack(mask)
    x = torch.randn(sum(lengths), args.dim, generator=torch.Generator().manual_seed(4))
    cos, sin = _rope_tables(*rope_cos_sin(rope_inv_freq(args), lay.positions, torch.float32))
    with torch.no_grad():
        got = attn(x, cos, sin, lay, None, 0)
        want = torch.cat(
            [
                layer_by_hand(attn, x[:6], args.n_heads, args.n_kv_heads, args.rope_theta, 1e-6),
                layer_by_hand(attn, x[6:], args.n_heads, args.n_kv_heads, args.rope_theta, 1e-6),
            ]
        )
    # as tests/unit/test_models_native_truths.py: ≤ 64·u per stage over 4 stages, 4x room
    tol = 4 * 64 * U32 * want.abs().max().item() * 4
    assert (got.double() - want).abs().max().item() <= tol


# ----------------------------------------------------------------------------------------------
# Device-specific branches, run on CPU tensors against the path the CPU takes


def varlen_by_hand(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
    """``torch.nn.attention.varlen.varlen_attn``'s documented contract, on CPU in float64:
    q [T, H, hd], k/v [T, H_kv, hd]; sequence i is rows [cu[i], cu[i+1]) (int32); window
    (-1, 0) is causal; with enable_gqa query head h reads key/value head h // (H / H_kv)."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max_q == max_k == max(lengths)
    assert tuple(window_size) == (-1, 0)
    assert enable_gqa == (q.shape[1] != k.shape[1])
    lay = SimpleNamespace(cu_seqlens=cu_q)
    return causal_by_hand(q, k, v, lay).to(q.dtype)


def test_varlen_path_equals_the_cpu_path():
    """The CUDA bf16/fp16 path (one varlen call for the stream) hands the kernel what its contract
    asks, and the kernel's answer equals what the CPU path computes."""
    lay, q, k, v = stream_qkv(seed=1)
    got = varlen_attention(q, k, v, lay, kernel=varlen_by_hand)
    cpu = bucketed_attention(q, k, v, lay)
    err = (got - cpu).abs().max().item()
    assert err <= attention_bound(q, k, v, lay.max_seqlen), err


def test_the_varlen_kernel_is_taken_for_cuda_half_precision_only():
    def t(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert uses_varlen_kernel(t("cuda", torch.bfloat16))
    assert uses_varlen_kernel(t("cuda", torch.float16))
    assert not uses_varlen_kernel(t("cuda", torch.float32))  # flash attention has no fp32
    assert not uses_varlen_kernel(t("cpu", torch.bfloat16))


def test_the_model_through_the_varlen_path_equals_the_cpu_path(monkeypatch):
    """The whole packed model with the CUDA branch forced (the stand-in kernel) gives the CPU
    path's logprobs: the [N, heads, hd] layout and the tables reach the kernel as it expects."""
    tokens, mask, pos = rollout_like(64)
    lay = pack(mask, start=P)
    model = model_of(torch.float32)
    kw = dict(position_ids=pos, start=P, packed=lay)
    with torch.no_grad():
        cpu = token_logprobs(model, tokens, **kw)
        monkeypatch.setattr(packing, "uses_varlen_kernel", lambda q: True)
        monkeypatch.setattr(packing, "_torch_varlen_attn", varlen_by_hand)
        forced = token_logprobs(model, tokens, **kw)
    scale = float(cpu.abs().max())
    assert (forced - cpu).abs().max() <= bound(model.args, torch.float32, scale)


@pytest.mark.parametrize("H, Hkv", [(4, 2), (8, 2)])
def test_masked_attention_with_repeated_heads_equals_native_gqa(H, Hkv):
    """The padded path's GPU branch (key/value heads repeated for the masked fused kernels),
    forced on CPU tensors, against the CPU's native GQA and the formula: head h reads key/value
    head h // (H / H_kv). Each head has its own scale and each key/value head its own offset,
    so heads repeated in another order (``repeat`` for ``repeat_interleave``: head h reading
    h % H_kv) fail; 8 over 2 (Qwen3's 4 query heads per key/value head) as well as 2 per head."""
    g = torch.Generator().manual_seed(2)
    B, S, hd = 2, 7, 8
    head_scale = torch.arange(1, H + 1, dtype=torch.float32)[None, :, None, None]
    q = torch.randn(B, H, S, hd, generator=g) * head_scale
    k = torch.randn(B, Hkv, S, hd, generator=g) * head_scale[:, :Hkv]
    v = torch.randn(B, Hkv, S, hd, generator=g) + torch.arange(Hkv)[None, :, None, None] * 3
    real = torch.ones(B, S, dtype=torch.bool)
    real[0, :3] = False  # left padding in row 0
    allowed = (torch.ones(S, S, dtype=torch.bool).tril()[None] & real[:, None, :]) | torch.eye(
        S, dtype=torch.bool
    )
    additive = torch.zeros(B, 1, S, S).masked_fill_(~allowed[:, None], float("-inf"))
    want = attention_by_hand(q, k, v, allowed)
    tol = attention_bound(q, k, v, S)
    for repeat in (True, False):
        got = masked_attention(q, k, v, additive, repeat_kv=repeat)
        err = (got.double() - want).abs().max().item()
        assert err <= tol, (repeat, err)


# ----------------------------------------------------------------------------------------------
# The packed model passes against the padded ones


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_logits_logprobs_entropy_and_values_equal_the_padded_ones(dtype):
    tokens, mask, pos = rollout_like(64)
    model, critic = model_of(dtype), model_of(dtype, critic=True)
    args = model.args
    lay, full = pack(mask, start=P), pack(mask)
    resp = mask[:, P:]
    with torch.no_grad():
        padded = model(tokens, attention_mask=mask, position_ids=pos)
        packed = model(tokens, position_ids=pos, packed=full)
        scale = float(padded[mask].abs().max())
        assert (packed[mask] - padded[mask]).abs().max() <= bound(args, dtype, scale)
        assert not packed[~mask].any()  # zeros at padding
        kw = dict(position_ids=pos, start=P, temperature=0.7)
        lp_pad, ent_pad = token_logprobs_and_entropy(model, tokens, attention_mask=mask, **kw)
        lp, ent = token_logprobs_and_entropy(model, tokens, packed=lay, **kw)
        assert lp.dtype == ent.dtype == torch.float32
        # logprobs are float32 (2u₃₂·max|z| for a logit rounding the other way) on top of the
        # model's difference of the logits, divided by T
        zmax = float(padded.abs().max()) / 0.7
        tol = 2 * U32 * zmax + bound(args, dtype, zmax)
        assert (lp - lp_pad)[resp].abs().max() <= tol
        assert (ent - ent_pad)[resp].abs().max() <= tol
        assert not lp[~resp].any() and not ent[~resp].any()
        v_pad = critic(tokens, attention_mask=mask, position_ids=pos)
        v = critic(tokens, position_ids=pos, packed=full)
        scale = float(v_pad[mask].abs().max())
        assert (v - v_pad)[mask].abs().max() <= bound(args, dtype, scale)
        assert not v[~mask].any()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gradients_equal_the_padded_ones(dtype):
    """∂/∂θ of Σ w·logprob (actor) and Σ w·value (critic) over the real response tokens. A
    gradient entry also sums one term per token (N ≤ B·S of them): 2·(K + B·S)·u·G per tensor
    with G its largest entry (as tests/distributed/test_one_vs_two_ranks.py); float32 logprobs
    round dz by 4u₃₂ relative (tests/unit/test_fused_policy_loss.py), summed over V logits. In
    bfloat16 the backward rounds its outputs as often as the forward (its sums accumulate in
    float32, B·S·u₃₂ ≪ u_bf16)."""
    tokens, mask, pos = rollout_like(64)
    model, critic = model_of(dtype), model_of(dtype, critic=True)
    args = model.args
    B, S = tokens.shape
    resp = mask[:, P:].float()
    w = torch.randn(B, R, generator=torch.Generator().manual_seed(5)) * resp
    wv = torch.randn(B, S, generator=torch.Generator().manual_seed(6)) * mask
    grads = {}
    for name, kw in (("padded", dict(attention_mask=mask)), ("packed", None)):
        lp = token_logprobs(
            model, tokens, position_ids=pos, start=P, **(kw or dict(packed=pack(mask, start=P)))
        )
        (lp * w).sum().backward()
        v = critic(tokens, position_ids=pos, **(kw or dict(packed=pack(mask))))
        (v.float() * wv).sum().backward()
        grads[name] = {**_grads(model), **{"critic." + n: g for n, g in _grads(critic).items()}}
    u = UNIT[dtype]
    reach = chain_length(args, S) + B * S
    for n, g in grads["padded"].items():
        G = float(g.abs().max())
        if dtype == torch.bfloat16:  # the forward's roundings and as many in backward
            tol = 2 * (2 * BF16_ROUNDINGS_PER_BLOCK * args.n_layers + 3) * U16 * G
        else:
            tol = 2 * reach * u * G + 4 * args.vocab_size * U32 * G
        err = float((grads["packed"][n] - g).abs().max())
        assert err <= tol, (n, err, tol)
    assert max(float(g.abs().max()) for g in grads["padded"].values()) > 0


@pytest.mark.parametrize("anchors", ["fixed", "token_anchors"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_fused_policy_loss_on_packed_input_equals_the_padded_one(agg, anchors):
    """The fused pass (lm_head + policy loss + KL) on packed input: its loss, statistics,
    logprobs and gradients are the padded pass's. The model runs in float64 (its own rounding is
    ~10⁹ times below float32's), the fused pass's logits in float32: a logit rounding the other
    way moves dz by 4u₃₂ relative, a gradient entry by ≤ 4·V·u₃₂·G (its tensor's largest)."""
    from minippo.rl.correction import CurrentAnchors, truncated_is_weights

    tokens, mask, pos = rollout_like(64)
    model = model_of(torch.float64)
    m = mask[:, P:].float()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        lp0 = token_logprobs(model, tokens, attention_mask=mask, position_ids=pos, start=P)
    mu = (lp0 + 0.3 * torch.randn(lp0.shape, generator=g)) * m
    spec_kw = dict(
        advantages=torch.randn(m.shape, generator=g) * m,
        response_mask=m,
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=1.5,
        agg_mode=agg,
        global_tokens=m.sum() + 3,
        global_seqs=(m.sum(1) > 0).sum().float() + 1,
        ref_logprobs=(lp0 + 0.2 * torch.randn(lp0.shape, generator=g)) * m,
        kl_estimator="k3",
        kl_coef=0.1,
    )
    if anchors == "fixed":
        spec = FusedLossSpec(
            anchor_logprobs=(lp0 + 0.3 * torch.randn(lp0.shape, generator=g)) * m,
            weights=(0.5 + torch.rand(m.shape, generator=g)) * m,
            keep_mask=(torch.rand(m.shape, generator=g) > 0.2).float(),
            **spec_kw,
        )
    else:  # tis-like anchors formed token by token from each chunk's logprobs
        out = CurrentAnchors(
            mu, m, lambda lp, mu_, mk: truncated_is_weights(lp, mu_, mk, cap=2.0), tokenwise=True
        )
        spec = FusedLossSpec(anchor_logprobs=None, token_anchors=out.token_anchors(), **spec_kw)
    results = {}
    for name, kw in (("padded", dict(attention_mask=mask)), ("packed", dict(packed=pack(mask, start=P)))):  # fmt: skip
        res = fused_policy_loss(model, tokens, spec, position_ids=pos, start=P, chunk_size=7, **kw)
        res.loss.backward()
        results[name] = (res, _grads(model))
    (pad, g_pad), (pk, g_pk) = results["padded"], results["packed"]
    V = model.args.vocab_size
    loss_scale = float(pad.loss.detach().abs()) + 1.0
    assert abs(float((pk.loss - pad.loss).detach())) <= 4 * V * U32 * loss_scale
    for a, b in ((pk.stats, pad.stats), (pk.kl_stats, pad.kl_stats)):
        for x, y in zip(a, b):
            assert abs(float(x) - float(y)) <= 4 * V * U32 * (abs(float(y)) + 1.0)
    lp_scale = float(pad.logprobs.abs().max())
    assert (pk.logprobs - pad.logprobs)[m > 0].abs().max() <= 4 * U32 * lp_scale
    assert not pk.logprobs[m == 0].any()
    for n, gp in g_pad.items():
        G = float(gp.abs().max())
        assert float((g_pk[n] - gp).abs().max()) <= 4 * V * U32 * G + 1e-300, n
    assert max(float(x.abs().max()) for x in g_pad.values()) > 0


def test_a_mistake_shows():
    """The comparisons above catch a pass that lets a sequence see its neighbours, or that
    scores a token from the wrong hidden state: each moves the logprobs far beyond the bound.
    (Positions need only restart per sequence up to a shift: RoPE sees relative positions.)"""
    tokens, mask, pos = rollout_like(64)
    model = model_of(torch.float32)
    lay = pack(mask, start=P)
    resp = mask[:, P:]
    with torch.no_grad():
        ref = token_logprobs(model, tokens, attention_mask=mask, position_ids=pos, start=P)
        tol = bound(model.args, torch.float32, float(ref.abs().max()))
        # one bucket spanning the whole stream: every token sees the sequences before it
        N = lay.num_tokens
        everything = packing.AttentionBucket(1, N, torch.arange(N), torch.arange(N))
        leaky = replace(lay, buckets=(everything,), bucket_order=torch.arange(N))
        crossed = token_logprobs(model, tokens, position_ids=pos, start=P, packed=leaky)
        assert (crossed - ref)[resp].abs().max() > 100 * tol
        # each token scored from its own hidden state instead of its predecessor's
        shifted = replace(lay, score_src=lay.score_src + 1)
        wrong = token_logprobs(model, tokens, position_ids=pos, start=P, packed=shifted)
        assert (wrong - ref)[resp].abs().max() > 100 * tol


def test_fp32_scores_of_a_batch_in_one_or_several_packs_agree():
    """Packing rows in other groups (micro-batches) changes nothing but rounding."""
    tokens, mask, pos = rollout_like(64)
    model = model_of(torch.float32)
    with torch.no_grad():
        whole = token_logprobs(model, tokens, position_ids=pos, start=P, packed=pack(mask, start=P))
        parts = [
            token_logprobs(
                model, tokens[r], position_ids=pos[r], start=P, packed=pack(mask[r], start=P)
            )
            for r in (torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4]))
        ]
    joined = torch.zeros_like(whole)
    joined[[0, 3, 5]], joined[[1, 2, 4]] = parts
    tol = bound(model.args, torch.float32, float(whole.abs().max()))
    assert (joined - whole).abs().max() <= tol


@pytest.mark.parametrize("fused", [False, True])
def test_a_micro_batch_without_response_tokens(fused):
    """Rows whose responses are all empty: nothing to score, zeros out, and a backward that
    reaches every parameter it used with zero gradients (a forward under FSDP still runs)."""
    tokens, mask, pos = rollout_like(64)
    rows = torch.tensor([2])  # the row without a response
    model = model_of(torch.float32)
    lay = pack(mask[rows], start=P)
    assert lay.score_src.numel() == 0
    kw = dict(position_ids=pos[rows], start=P, packed=lay)
    if fused:
        m = mask[rows, P:].float()
        spec = FusedLossSpec(anchor_logprobs=m, advantages=m, response_mask=m)
        out = fused_policy_loss(model, tokens[rows], spec, **kw)
        lp, loss = out.logprobs, out.loss
    else:
        lp, _ = token_logprobs_and_entropy(model, tokens[rows], **kw)
        loss = lp.sum()
    assert lp.shape == (1, R) and not lp.any()
    loss.backward()
    assert model.output.weight.grad is not None and not model.output.weight.grad.any()


def test_every_shipped_training_config_packs():
    """Packing and balancing the ranks' tokens are the defaults, and every shipped async_ppo
    config says so in its ppo section (a user copying one sees the keys and their comments)."""
    from pathlib import Path

    import yaml

    from minippo._cli import registry

    root = Path(__file__).resolve().parents[2] / "configs"
    (recipe,) = [r for r in registry.RECIPES if r.name == "async_ppo"]
    for config in recipe.configs:
        ppo = yaml.safe_load((root / config.file_path).read_text())["ppo"]
        assert ppo.get("pack") is True, f"{config.file_path}: ppo.pack is {ppo.get('pack')!r}"
        balance = ppo.get("balance_ranks")
        assert balance is True, f"{config.file_path}: ppo.balance_ranks is {balance!r}"
