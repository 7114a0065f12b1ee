"""One decoder-only transformer covering Qwen3, Qwen2 and Llama-3 as options of the same code.

Shapes: B batch, S new tokens, S_kv keys (cached + new), D model dim, H query heads, H_kv key/value
heads, hd head dim, V vocabulary.

Block (pre-norm, as in all three families):
    h = x + wo(attn(rope(q_norm(wq(n1(x)))), rope(k_norm(wk(n1(x)))), wv(n1(x))))
    y = h + w2(silu(w1(n2(h))) * w3(n2(h)))          # SwiGLU; w1 = gate, w3 = up, w2 = down
with n1/n2 RMSNorm, q_norm/k_norm (Qwen3 only) RMSNorm over each head, grouped-query attention
(H_kv divides H) through ``F.scaled_dot_product_attention``.

RoPE tables are not module state: the inverse frequencies are a pure function of ``ModelArgs``
(:func:`rope_inv_freq`) and cos/sin are computed from ``position_ids`` in every forward. So a model
built on the meta device and materialised with ``to_empty`` has nothing to recompute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from minippo.models.fused_policy_loss import FusedPolicyOutput, fused_policy_loss_from_hidden
from minippo.models.logprobs import (
    ScoreSpec,
    check_score_args,
    logprobs_from_hidden,
)
from minippo.models.packing import PackedLayout, packed_attention

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


@dataclass
class ModelArgs:
    """Hyper-parameters of the decoder (names follow the HF config where one exists).

    Fields:
        vocab_size:          V
        dim:                 D, hidden size
        n_layers:            number of decoder blocks
        n_heads:             H, query heads
        n_kv_heads:          H_kv, key/value heads (H % H_kv == 0)
        head_dim:            hd (Qwen3 sets it explicitly; otherwise D // H)
        intermediate_size:   SwiGLU hidden size
        norm_eps:            RMSNorm epsilon
        rope_theta:          RoPE base
        rope_scaling:        None, or {"rope_type": "llama3", "factor", "low_freq_factor",
                             "high_freq_factor", "original_max_position_embeddings"}
        max_seq_len:         max_position_embeddings (informational; RoPE has no table)
        tie_word_embeddings: lm_head shares the embedding matrix
        qk_norm:             RMSNorm on each q/k head before RoPE (Qwen3)
        qkv_bias:            bias on wq/wk/wv (Qwen2: True)
        o_bias:              bias on wo
        mlp_bias:            bias on w1/w2/w3 (Llama ``mlp_bias``)
        architecture:        HF class name written to config.json on save
        extra_hf_config:     other config.json keys kept for a faithful save (eos ids, dtype...)
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "Qwen3ForCausalLM"
    extra_hf_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) "
                    "when head_dim is not given; set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported; supported: 'llama3', 'default'"
                )


# ----------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE, float32 ``[hd / 2]``.

    default:  inv_freq_i = 1 / theta^(2i / hd)
    llama3:   wavelen_i = 2π / inv_freq_i; long waves (wavelen > L / low_freq_factor) are divided by
              ``factor``, short waves (wavelen < L / high_freq_factor) are kept, the band between is
              interpolated with s = (L / wavelen - low) / (high - low):
              inv = (1 - s) * inv / factor + s * inv,  L = original_max_position_embeddings.
    """
    hd = args.head_dim
    # computed on CPU in float32 (what the reference implementation does), then moved
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    scaling = args.rope_scaling
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        s = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - s) * scaled / factor + s * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.to(device) if device is not None else inv_freq


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, S, hd]`` for ``position_ids [B, S]`` (angles in float32).

    angle[b, s, i] = pos[b, s] * inv_freq[i mod hd/2]   (halves duplicated: non-interleaved RoPE)
    """
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, S, hd]`` by the angles of ``cos/sin [B, S, hd]``.

    x' = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]
    """
    return _rope(x, *_rope_tables(cos, sin))


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables :func:`_rope` takes, made once per forward: ``cos`` and the signed sine
    ``[-sin₁, sin₂]`` (halves), each ``[B, 1, S, hd]`` (one head axis) from ``[B, S, hd]``; from
    a packed stream's ``[N, hd]``, ``[N, 1, hd]``."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the tables of :func:`_rope_tables`: rotate_half(x)·sin is
    [x₂, x₁]·[-sin₁, sin₂], so one roll replaces the split, negation and concatenation (the same
    products, bit for bit, forward and backward)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# ----------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 then cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNorm.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]  # no graph: skip the node's overhead

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The formula of :class:`RMSNorm`: (output, fp32 normed input, rsqrt)."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * rstd
    return weight * h.to(x.dtype), h, rstd


class _RMSNorm(torch.autograd.Function):
    """RMSNorm as one autograd node: the forward is the formula of :class:`RMSNorm` op for op;
    the backward is written out (7 ops instead of the ~16 autograd records for the formula,
    the same values up to float32 rounding). With x̂ = x·r, r = (mean(x²) + eps)^(-1/2), y = w·x̂:

        dw = Σ_rows g·x̂          dx = r·(ĝ − x̂·mean(ĝ·x̂)),  ĝ = g·w (in float32)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, h, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(h, rstd, weight)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        if torch.is_grad_enabled():  # create_graph: the saved tensors carry no graph to x
            raise RuntimeError(
                "RMSNorm's autograd node has no second derivative (backward with create_graph)"
            )
        h, rstd, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * h.to(g.dtype)).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gh = (g * weight).float()
            dx = (rstd * (gh - h * (gh * h).mean(-1, keepdim=True))).to(ctx.x_dtype)
        return dx, dw, None


class KVCache:
    """Keys/values of every layer for a batch of sequences that advance together.

    Tensors per layer: ``k, v [B, H_kv, max_len, hd]``; ``length`` is the number of cached positions
    (the same for all rows: rows of different lengths are handled with the padding
    ``attention_mask`` over all keys). A forward with the cache writes the new tokens' k/v at
    ``[length, length + S)`` and then advances ``length`` by S.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(
                f"KVCache needs batch_size >= 1 and max_len >= 1, got {batch_size=}, {max_len=}"
            )
        shape = (batch_size, args.n_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.max_len = max_len
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``[B, H_kv, max_len, hd]`` of layer ``i``: what its block
        reads and writes (:func:`cache_kv`)."""
        return self.k[i], self.v[i]

    def keep(self, rows: torch.Tensor | Sequence[int]) -> KVCache:
        """Keep only ``rows`` (Long[k], indices into the current batch), in that order; returns self.

        Used to drop finished sequences so that they stop costing compute.
        """
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.k[0].device)
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        return self


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hd = args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, hd
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | PackedLayout | None,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
        start: int,
    ) -> torch.Tensor:
        """x [B·S, D] (rows are tokens) -> [B·S, D]; ``cos/sin [B, 1, S, hd]``
        (:func:`_rope_tables`, which also give B and S); ``mask`` [B, 1, S, S_kv] in x's dtype, 0
        where a query may attend and -inf elsewhere (:func:`attention_mask_4d` made additive,
        once per forward), or None (causal). With a :class:`PackedLayout` as ``mask``, x is a
        packed stream [N, D] and ``cos/sin`` are [N, 1, hd] (see :meth:`_packed`). ``kv``: this
        layer's cache buffers (:meth:`KVCache.layer`) with ``start`` positions cached, or None."""
        if isinstance(mask, PackedLayout):
            return self._packed(x, cos, sin, mask)
        B, S = cos.shape[0], cos.shape[2]
        q, k, v = self._qkv(x, B, S)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, hd]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if kv is not None:
            k, v = cache_kv(kv, k, v, start)
        if mask is None:
            # no padding: plain causal attention (flash kernels handle GQA natively); with a cache
            # only reached for a first chunk (keys == queries) or one new token (sees all keys);
            # a single query needs no causal mask either way
            gqa = self.n_heads != self.n_kv_heads
            out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=gqa)
        else:
            out = masked_attention(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B * S, -1))

    def _packed(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        """A packed stream: x [N, D] -> [N, D], q/k/v as [N, heads, hd] (the varlen kernels'
        layout), RoPE tables [N, 1, hd], attention causal inside each sequence of ``layout``."""
        N = x.shape[0]
        q, k, v = self._qkv(x, N)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return self.wo(packed_attention(q, k, v, layout).reshape(N, -1))

    def _qkv(self, x: torch.Tensor, *lead: int) -> tuple[torch.Tensor, ...]:
        """q, k, v of the rows of x as ``[*lead, heads, hd]``, q and k RMS-normed (Qwen3)."""
        q = self.wq(x).view(*lead, self.n_heads, self.head_dim)
        k = self.wk(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(*lead, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


def cache_kv(
    kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``k, v [B, H_kv, S, hd]`` into the buffers ``kv`` ``[B, H_kv, max_len, hd]`` at
    ``[start, start + S)``; return keys/values ``[B, H_kv, start + S, hd]`` (cached + new)."""
    end = start + k.shape[2]
    kv[0][:, :, start:end] = k
    kv[1][:, :, start:end] = v
    return kv[0][:, :, :end], kv[1][:, :, :end]


def repeats_kv_for_mask(q: torch.Tensor) -> bool:
    """Whether :func:`masked_attention` repeats the key/value heads for ``q``: off the CPU. The
    masked fused GPU kernels do not take GQA, and repeating k/v (H/H_kv copies of
    [B, H_kv, S_kv, hd]) is far cheaper than the [B, H, S, S_kv] math fallback; the CPU flash
    kernel takes a mask and GQA together (the same output as with repeated k/v)."""
    return q.device.type != "cpu"


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    repeat_kv: bool | None = None,
) -> torch.Tensor:
    """SDPA of ``q [B, H, S, hd]`` over ``k, v [B, H_kv, S_kv, hd]`` with the additive ``mask
    [B, 1, S, S_kv]`` (the padded path) -> [B, H, S, hd]. Query head h reads key/value head
    h // (H / H_kv): natively (``enable_gqa``), or, with ``repeat_kv`` (default
    :func:`repeats_kv_for_mask`; a test forces it on CPU tensors), from k/v with every head
    repeated H / H_kv times in place."""
    rep = q.shape[1] // k.shape[1]
    if repeat_kv is None:
        repeat_kv = repeats_kv_for_mask(q)
    if rep > 1 and q.shape[2] > 1 and repeat_kv:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        rep = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)  # gate
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)  # down
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One decoder block. It holds no per-layer Python state (no layer index): its forward reads
    only tensors and the attributes every block shares, so that ``compile: true`` traces one graph
    for all the blocks of a model (torch.compile specialises on int attributes of a module and
    would compile, and cache, one graph per block)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | PackedLayout | None,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
        start: int,
    ) -> torch.Tensor:
        """x [B·S, D] (or a packed stream [N, D]) -> the same shape (see
        :meth:`Attention.forward`; ``kv``: this block's :meth:`KVCache.layer` or None)."""
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, kv, start)
        return h + self.feed_forward(self.ffn_norm(h))


def attention_mask_4d(
    attention_mask: torch.Tensor | None, start: int, S: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean attention mask ``[B, 1, S, start + S]`` (True = may attend), or None when plain
    causal attention suffices.

    allowed[b, i, j] = (j <= start + i and attention_mask[b, j]) or j == start + i
    The diagonal is always allowed so that a padding query never has an empty row (no NaN); real
    queries always see themselves anyway, so their outputs are unchanged.
    """
    if attention_mask is None:
        if start == 0 or S == 1:
            return None
        attention_mask = torch.ones(1, start + S, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2 or attention_mask.shape[1] != start + S:
        raise ValueError(
            f"attention_mask must be [B, S_kv] with S_kv = cached ({start}) + new ({S}) = "
            f"{start + S}, got shape {tuple(attention_mask.shape)}"
        )
    q_pos = torch.arange(start, start + S, device=device)[:, None]
    k_pos = torch.arange(start + S, device=device)[None, :]
    causal = k_pos <= q_pos  # [S, S_kv]
    allowed = (causal[None] & attention_mask.bool()[:, None, :]) | (k_pos == q_pos)[None]
    return allowed[:, None]  # [B, 1, S, S_kv]


class _Decoder(nn.Module):
    """Embeddings, blocks and final norm shared by the LM and the value model."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.args, device)
        return self._inv_freq[device]

    def hidden_states(
        self,
        tokens: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        packed: PackedLayout | None = None,
    ) -> torch.Tensor:
        """tokens Long[B, S] -> final-normed hidden states [B, S, D]; with ``packed``, those of
        its real tokens only, as the packed stream [N, D] (``attention_mask`` is then not read:
        the layout says where the real tokens are)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be Long[B, S], got shape {tuple(tokens.shape)}")
        if packed is not None:
            return self._packed_hidden_states(tokens, position_ids, kv_cache, packed)
        B, S = tokens.shape
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            if kv_cache.batch_size != B:
                raise ValueError(
                    f"kv_cache holds {kv_cache.batch_size} rows but tokens has batch {B}; "
                    "call kv_cache.keep(rows) to drop finished rows"
                )
            if start + S > kv_cache.max_len:
                raise ValueError(
                    f"kv_cache overflow: {start} cached + {S} new > max_len {kv_cache.max_len}"
                )
        if position_ids is None:
            position_ids = torch.arange(start, start + S, device=tokens.device).expand(B, S)
        elif position_ids.shape != tokens.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        # the blocks take the residual stream as [B·S, D]: 2-D inputs go to the matrix multiply
        # as they are, with no reshape (and its backward node) around every linear layer
        h = self.tok_embeddings(tokens.reshape(-1))
        cos, sin = _rope_tables(*rope_cos_sin(self._rope_inv_freq(h.device), position_ids, h.dtype))
        mask = attention_mask_4d(attention_mask, start, S, tokens.device)
        if mask is not None:  # the additive form SDPA would otherwise build in every block
            mask = torch.zeros_like(mask, dtype=h.dtype).masked_fill_(~mask, float("-inf"))
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, None if kv_cache is None else kv_cache.layer(i), start)
        if kv_cache is not None:
            kv_cache.length = start + S
        return self.norm(h).view(B, S, -1)

    def _packed_hidden_states(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        packed: PackedLayout,
    ) -> torch.Tensor:
        """The packed forward: the real tokens of ``tokens [b, S]`` as one stream [N, D];
        positions from ``position_ids`` at those tokens (default: each sequence's own 0, 1, ...)."""
        if kv_cache is not None:
            raise ValueError("packed sequences are a training/scoring pass: no kv_cache")
        if tuple(tokens.shape) != packed.shape:
            raise ValueError(
                f"tokens shape {tuple(tokens.shape)} != the packed layout's {packed.shape}"
            )
        if position_ids is not None and position_ids.shape != tokens.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        pos = packed.positions if position_ids is None else packed.gather(position_ids)
        h = self.tok_embeddings(packed.gather(tokens))
        # tables [N, 1, hd]: one per stream token, broadcast over the heads of [N, heads, hd]
        cos, sin = _rope_tables(*rope_cos_sin(self._rope_inv_freq(h.device), pos, h.dtype))
        for layer in self.layers:
            h = layer(h, cos, sin, packed, None, 0)
        return self.norm(h)


class Transformer(_Decoder):
    """Causal LM: decoder + lm_head (``output``, tied to ``tok_embeddings`` when
    ``args.tie_word_embeddings``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding Parameter when ``args.tie_word_embeddings``."""
        if self.args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # ``to_empty`` from meta (and any device move that cannot swap data in place) creates a
        # new Parameter per module, which would silently untie the lm_head; tie it again.
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        score: ScoreSpec | None = None,
        packed: PackedLayout | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | FusedPolicyOutput:
        """Logits ``[B, S, V]`` (dtype of the weights) for ``tokens Long[B, S]``.

        position_ids:   Long[B, S]; default ``cached + arange(S)`` (pass it with left padding).
        attention_mask: Bool[B, S_kv] padding mask over all keys (cached + new); causal masking is
                        always applied on top.
        kv_cache:       appends the new k/v after the cached ones and advances ``kv_cache.length``.
        return_hidden:  return the final-normed hidden states ``[B, S, D]`` instead of logits.
        score:          return ``Float32[B, S - start]`` logprobs of ``tokens[:, start:]`` (and
                        entropies if asked) instead of logits, chunk by chunk; used by
                        :func:`~minippo.models.token_logprobs`; with ``score.fused`` the fused
                        policy loss of those logprobs (:func:`~minippo.models.fused_policy_loss`).
        packed:         compute on the real tokens only, packed into one stream
                        (:mod:`minippo.models.packing`; ``attention_mask`` is not read); every
                        output keeps its padded shape, zeros at padding. With ``score``, the
                        layout must be packed with ``start = score.start``: only the real tokens
                        at columns >= start are scored (the lm_head runs on those rows alone).
        """
        if score is not None:
            if kv_cache is not None or return_hidden:
                raise ValueError("score cannot be combined with kv_cache or return_hidden")
            check_score_args(tokens, score.temperature, score.start, score.chunk_size)
            if packed is not None and packed.start != score.start:
                raise ValueError(
                    f"the packed layout was made with start={packed.start}, the score asks for "
                    f"start={score.start}; pack with start={score.start}"
                )
        h = self.hidden_states(
            tokens,
            position_ids=position_ids,
            attention_mask=attention_mask,
            kv_cache=kv_cache,
            packed=packed,
        )
        if score is None:
            out = h if return_hidden else self.output(h)
            return out if packed is None else packed.scatter(out)
        if packed is None:  # every position from start - 1 predicts the next token
            hidden, targets, positions = h[:, score.start - 1 : -1], tokens[:, score.start :], None
        else:  # the predecessors of the scored real tokens only
            hidden = h[packed.score_src]
            targets = tokens[packed.score_rows, packed.score_cols + score.start]
            positions = packed.scored_flat_index()
        if score.fused is not None:
            return fused_policy_loss_from_hidden(
                hidden,
                self.output.weight,
                targets,
                score.fused,
                temperature=score.temperature,
                chunk_size=score.chunk_size,
                positions=positions,
            )
        out = logprobs_from_hidden(
            hidden if packed is None else hidden[None],
            self.output,
            targets if packed is None else targets[None],
            temperature=score.temperature,
            chunk_size=score.chunk_size,
            with_entropy=score.with_entropy,
            entropy_grad=score.entropy_grad,
        )
        if packed is None:
            return out
        if score.with_entropy:
            return packed.scatter_scored(out[0][0]), packed.scatter_scored(out[1][0])
        return packed.scatter_scored(out[0])


class ValueModel(_Decoder):
    """Critic: the same decoder with a scalar head ``value_head: Linear(D, 1)``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(replace(args, tie_word_embeddings=False))
        self.value_head = nn.Linear(args.dim, 1, bias=True)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        packed: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Values ``Float32[B, S]``: v[b, s] estimates the return after token s. The head runs in
        float32 whatever the compute dtype (a bf16 output would round every value to 8 bits, and
        the returns, advantages and value loss are made of them; the head is one row of weights).
        ``packed``: computed on the real tokens only (see :meth:`Transformer.forward`), 0 at
        padding."""
        h = self.hidden_states(
            tokens, position_ids=position_ids, attention_mask=attention_mask, packed=packed
        )
        head = self.value_head
        v = F.linear(h.float(), head.weight.float(), head.bias.float()).squeeze(-1)
        if packed is not None:  # scatter makes a fresh [B, S] tensor
            return packed.scatter(v)
        # a tensor of its own, not a view of the head's [B, S, 1] output: FSDP2 hooks the output
        # of the root module for backward, and a view of it would lose that hook to an in-place op
        return v.clone()


# ----------------------------------------------------------------------------------------------
# Initialisation


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Random init for tests and toy tasks; returns ``model``.

    Linear/Embedding weights ~ N(0, std²), biases 0, RMSNorm weights 1, ``value_head`` 0 (a critic
    starts predicting 0). Values are drawn on CPU from ``torch.Generator().manual_seed(seed)`` in
    parameter order, so the same seed gives the same weights on every device. Works after
    ``model.to_empty(device=...)`` of a meta-built model, also FSDP-sharded (every rank draws the
    full tensor and keeps its shard: no communication, same weights as unsharded).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied weights appear once
        if p.device.type == "meta":
            raise ValueError(
                f"parameter {name} is on the meta device; call model.to_empty(device=...) first"
            )
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("value_head") or leaf == "bias":
            value = torch.zeros(p.shape)
        elif name.endswith("norm.weight"):
            value = torch.ones(p.shape)
        else:
            value = torch.empty(p.shape).normal_(0.0, std, generator=gen)
        value = value.to(device=p.device, dtype=p.dtype)
        if hasattr(p, "device_mesh"):  # a DTensor shard: keep this rank's part
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(value)
    return model


# ----------------------------------------------------------------------------------------------
# Size builders (return ModelArgs: build with Transformer(args) / ValueModel(args))


def qwen3_tiny(vocab_size: int = 64) -> ModelArgs:
    """A 2-layer Qwen3 for tests and toy tasks (~0.1M parameters; vocab 64 covers TinyTokenizer)."""
    return ModelArgs(
        vocab_size=vocab_size,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        norm_eps=1e-6,
        rope_theta=10_000.0,
        max_seq_len=512,
        tie_word_embeddings=True,
    )


def _qwen3(dim: int, n_layers: int, n_heads: int, inter: int, tie: bool) -> ModelArgs:
    return ModelArgs(
        vocab_size=151_936,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        intermediate_size=inter,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=40_960,
        tie_word_embeddings=tie,
    )


def qwen3_0_6b() -> ModelArgs:
    """Qwen3-0.6B."""
    return _qwen3(1024, 28, 16, 3072, tie=True)


def qwen3_1_7b() -> ModelArgs:
    """Qwen3-1.7B."""
    return _qwen3(2048, 28, 16, 6144, tie=True)


def qwen3_4b() -> ModelArgs:
    """Qwen3-4B."""
    return _qwen3(2560, 36, 32, 9728, tie=True)


def qwen3_8b() -> ModelArgs:
    """Qwen3-8B."""
    return _qwen3(4096, 36, 32, 12288, tie=False)


def qwen2_5_0_5b() -> ModelArgs:
    """Qwen2.5-0.5B (qkv bias, no q/k norm)."""
    return ModelArgs(
        vocab_size=151_936,
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        intermediate_size=4864,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=32_768,
        tie_word_embeddings=True,
        qk_norm=False,
        qkv_bias=True,
        architecture="Qwen2ForCausalLM",
    )


def llama3_2_1b() -> ModelArgs:
    """Llama-3.2-1B (llama3 RoPE scaling, no q/k norm)."""
    return ModelArgs(
        vocab_size=128_256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_seq_len=131_072,
        tie_word_embeddings=True,
        qk_norm=False,
        architecture="LlamaForCausalLM",
    )
