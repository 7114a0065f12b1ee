"""What the native model must compute, checked against formulas written out by hand (no
``transformers`` needed): the RoPE rotation, attention that depends only on relative positions,
grouped-query attention as explicit key/value repetition, and llama3 RoPE scaling.

Tolerances are float32 rounding: u = 2⁻²⁴ (unit roundoff). The hand computations run in float64,
so their own rounding is negligible next to the model's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from minippo.models import ModelArgs, Transformer, init_weights, llama3_2_1b, qwen3_tiny
from minippo.models.model import _rope_tables, apply_rope, rope_cos_sin, rope_inv_freq

U = torch.finfo(torch.float32).eps / 2  # 2⁻²⁴


def rotate_by_hand(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """RoPE of one head vector ``x [hd]`` at position ``pos``, in float64, pair by pair.

    Non-interleaved (HF "rotate_half") layout: coordinate i pairs with i + hd/2, and the pair is
    rotated counter-clockwise by the angle pos · θ^(−2i/hd):
        x'_i        = x_i cos a − x_{i+hd/2} sin a
        x'_{i+hd/2} = x_i sin a + x_{i+hd/2} cos a
    """
    hd = x.numel()
    out = torch.empty(hd, dtype=torch.float64)
    for i in range(hd // 2):
        a = pos * theta ** (-2 * i / hd)
        x1, x2 = float(x[i]), float(x[i + hd // 2])
        out[i] = x1 * math.cos(a) - x2 * math.sin(a)
        out[i + hd // 2] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


def test_rope_rotates_each_pair_by_position_times_frequency():
    args = qwen3_tiny()  # head_dim 16, θ = 10 000
    hd = args.head_dim
    positions = [0, 1, 2, 7, 100, 511]
    x = torch.randn(1, 1, len(positions), hd, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([positions])
    cos, sin = rope_cos_sin(rope_inv_freq(args), pos, torch.float32)
    got = apply_rope(x, cos, sin)[0, 0]
    for s, p in enumerate(positions):
        want = rotate_by_hand(x[0, 0, s], p, args.rope_theta)
        # float32: the angle p·f is rounded once (≤ u·p since f ≤ 1) after f itself (a float32
        # power, ≤ 4u relative), cos/sin add ≤ u each, and x·cos + r·sin two more roundings:
        # |error| ≤ |x|_max · (2·(5u·p + u) + 4u) per coordinate.
        bound = x[0, 0, s].abs().max().item() * (2 * (5 * U * p + U) + 4 * U)
        err = (got[s].double() - want).abs().max().item()
        assert err <= bound, (p, err, bound)
    # the rotation keeps each pair's length (a rotation, not a scaling)
    assert torch.allclose(got.norm(dim=-1), x[0, 0].norm(dim=-1), rtol=1e-6)


def test_attention_scores_depend_only_on_relative_position():
    """q_m · k_n after RoPE equals q_{m+s} · k_{n+s}: the score sees m − n only."""
    args = qwen3_tiny()
    hd = args.head_dim
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 1, 1, hd, generator=g).unbind(0)
    inv = rope_inv_freq(args)
    for m, n, s in [(5, 2, 0), (5, 2, 17), (5, 2, 300), (0, 9, 40), (33, 33, 123)]:
        scores = []
        for shift in (0, s):
            cq, sq = rope_cos_sin(inv, torch.tensor([[m + shift]]), torch.float32)
            ck, sk = rope_cos_sin(inv, torch.tensor([[n + shift]]), torch.float32)
            scores.append((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item())
        # each side's angles are rounded by ≤ u·(pos + 1) (f ≤ 1), then the rotation and the
        # hd-term dot product round ≤ (hd + 4)·u relative to Σ|q||k|
        scale = (q.abs() * k.abs()).sum().item() * 2  # a rotated pair's |q||k| ≤ 2 Σ|q_i||k_i|
        bound = scale * (2 * U * (max(m, n) + s + 1) * 2 + (hd + 4) * U)
        assert abs(scores[0] - scores[1]) <= bound, (m, n, s, scores)
    # and it does depend on the relative position
    c0, s0 = rope_cos_sin(inv, torch.tensor([[3]]), torch.float32)
    c1, s1 = rope_cos_sin(inv, torch.tensor([[4]]), torch.float32)
    a = (apply_rope(q, c0, s0) * apply_rope(k, c0, s0)).sum()
    b = (apply_rope(q, c1, s1) * apply_rope(k, c0, s0)).sum()
    assert abs(a - b) > 1e-3


def test_model_logits_do_not_change_when_every_position_is_shifted():
    """No absolute position enters the model: shifting all position ids by s leaves the logits
    unchanged (with and without left padding)."""
    model = init_weights(Transformer(qwen3_tiny()), seed=0, std=0.1)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(tokens, attention_mask=mask, position_ids=pos)
        for s in (1, 25):
            out = model(tokens, attention_mask=mask, position_ids=pos + s)
            # angles round by ≤ u·(9 + s) rad (< 3e-6): the logits move by that relative amount
            # at most, far below 1e-5 (the tolerance of same-math comparisons in test_models)
            torch.testing.assert_close(out[mask], ref[mask], rtol=0, atol=1e-5)
        moved = model(tokens, attention_mask=mask, position_ids=pos.flip(-1))
        assert (moved[mask] - ref[mask]).abs().max() > 1e-3  # order matters, offset does not


def attention_by_hand(attn, x: torch.Tensor, n_heads: int, n_kv: int, theta: float, eps: float):
    """One causal attention layer for ``x [S, D]`` (positions 0..S-1) in float64, head by head:
    projections, per-head RMSNorm of q and k, RoPE by hand, softmax(q·k/√hd), the output
    projection. Query head h reads key/value head h // (n_heads / n_kv)."""
    S = x.shape[0]
    hd = attn.head_dim
    x = x.double()
    q = (x @ attn.wq.weight.double().T).view(S, n_heads, hd)
    k = (x @ attn.wk.weight.double().T).view(S, n_kv, hd)
    v = (x @ attn.wv.weight.double().T).view(S, n_kv, hd)

    def rms(t, w):
        return w.double() * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    out = torch.zeros(S, n_heads, hd, dtype=torch.float64)
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        for i in range(S):
            qi = rotate_by_hand(q[i, h], i, theta)
            scores = torch.stack(
                [qi @ rotate_by_hand(k[j, kv], j, theta) for j in range(i + 1)]
            ) / math.sqrt(hd)
            p = torch.softmax(scores, dim=0)
            out[i, h] = p @ v[: i + 1, kv]
    return out.reshape(S, -1) @ attn.wo.weight.double().T


@pytest.mark.parametrize("padded", [False, True])
def test_attention_layer_equals_the_formula_written_out(padded):
    """Attention (GQA: 4 query heads on 2 kv heads) against the hand computation, through both
    paths of the layer: plain causal (SDPA's native GQA) and with an additive padding mask."""
    args = qwen3_tiny()
    model = init_weights(Transformer(args), seed=3, std=0.2)
    attn = model.layers[0].attention
    S = 6
    x = torch.randn(1, S, args.dim, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S)[None]
    cos, sin = _rope_tables(*rope_cos_sin(rope_inv_freq(args), pos, torch.float32))
    mask = None
    if padded:  # the additive form the decoder hands its blocks
        allowed = torch.ones(1, 1, S, S, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, S, S).masked_fill_(~allowed, float("-inf"))
    with torch.no_grad():
        got = attn(x[0], cos, sin, mask, None, 0)  # the blocks take rows of tokens [B·S, D]
        want = attention_by_hand(attn, x[0], args.n_heads, args.n_kv_heads, args.rope_theta, 1e-6)
    # float32 chain of dot products of length ≤ max(D, H·hd) = 64 plus the RoPE angle rounding:
    # ≤ 64·u relative per stage over 4 stages (projection, scores, softmax·v, output), applied
    # to the output's scale
    bound = 4 * 64 * U * want.abs().max().item() * 4
    err = (got.double() - want).abs().max().item()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("padded", [False, True])
def test_gqa_equals_full_attention_with_repeated_key_value_heads(padded):
    """n_kv_heads = 2 equals n_kv_heads = 4 whose key/value heads are the 2 heads repeated in
    place (head h reads kv head h // 2): the model with grouped heads and the one with explicit
    copies give the same logits."""
    gqa_args = qwen3_tiny()
    assert gqa_args.n_heads // gqa_args.n_kv_heads == 2
    full_args = replace(gqa_args, n_kv_heads=gqa_args.n_heads)
    gqa = init_weights(Transformer(gqa_args), seed=5, std=0.2)
    full = Transformer(full_args)
    sd = gqa.state_dict()
    hd = gqa_args.head_dim
    for name, w in list(sd.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = w.view(gqa_args.n_kv_heads, hd, -1)
            sd[name] = heads.repeat_interleave(2, dim=0).reshape(-1, w.shape[-1])
    full.load_state_dict(sd)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(6))
    kw = {}
    if padded:
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[0, :3] = False
        kw = dict(attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        a, b = gqa(tokens, **kw), full(tokens, **kw)
    # the same arithmetic, only the attention kernel differs: rounding-level agreement
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def llama3_inv_freq_by_formula(args: ModelArgs) -> list[float]:
    """Llama 3.1's RoPE scaling, written as in Meta's reference (``apply_scaling``), in float64:
    wavelengths shorter than L / high_freq_factor keep their frequency, longer than
    L / low_freq_factor are divided by ``factor``, and the band between interpolates
    (1 − s)·f / factor + s·f with s = (L / wavelength − low) / (high − low)."""
    sc = args.rope_scaling
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    hd = args.head_dim
    out = []
    for i in range(0, hd, 2):
        f = 1.0 / args.rope_theta ** (i / hd)
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            out.append(f)
        elif wavelen > old_len / low:
            out.append(f / factor)
        else:
            s = (old_len / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return out


def test_llama3_rope_scaling_follows_its_formula():
    args = llama3_2_1b()  # factor 32, low 1, high 4, L = 8192, head_dim 64, θ = 500 000
    want = torch.tensor(llama3_inv_freq_by_formula(args), dtype=torch.float64)
    got = rope_inv_freq(args).double()
    plain = rope_inv_freq(replace(args, rope_scaling=None)).double()
    # all three bands occur in this configuration
    ratio = plain / want  # 1 (kept), 32 (divided) or between (interpolated), to float32 precision
    assert ((ratio - 1).abs() < 1e-5).any() and ((ratio / 32 - 1).abs() < 1e-5).any()
    assert ((ratio > 1.001) & (ratio < 31.99)).any()
    # float32: the base frequency (a power: ≤ 4u), the band division (u) and the interpolation
    # (≤ 6 operations, whose s carries the relative error of L / wavelength): ≤ 16u relative
    err = ((got - want).abs() / want).max().item()
    assert err <= 16 * U, err
