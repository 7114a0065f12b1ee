"""Packed sequences: the real tokens of a padded batch as one stream, and attention over it.

A batch in the RolloutBatch layout, ``[b, S]`` with each row's real tokens contiguous (a
left-padded prompt followed by a right-padded response), computes on b·S positions when padded.
Packed, the real tokens of the b rows follow each other in one stream of N = Σ Lᵢ tokens, row
after row; positions restart at 0 in every sequence (RoPE sees what it sees padded) and attention
is causal inside each sequence and never crosses into another one. No ``[b, 1, S, S]`` mask
exists: the linear layers run on N rows, the attention on each sequence's own Lᵢ² scores.

:func:`pack` builds a :class:`PackedLayout` on the host from a host copy of the attention mask
(indices only; nothing reads the device). The models take it as ``packed=`` and return the same
padded shapes as without it (zeros where a padded pass returns meaningless values), so every
per-token RL tensor keeps its ``[b, R]`` meaning.

Attention over the stream (:func:`packed_attention`): on CUDA in bf16/fp16 one varlen flash
kernel call (``torch.nn.attention.varlen.varlen_attn``) over all sequences; elsewhere (CPU, and
fp32 on CUDA, which the flash kernel does not take) :func:`bucketed_attention`: the sequences in
buckets of similar length, each bucket one causal SDPA call over its sequences right-padded to
its longest. Right padding puts every pad after its sequence's real tokens, so causal attention
never reads a pad: each real token's output is that of its sequence alone. One call per sequence
would be exact too, but a CPU SDPA call (forward and backward) costs ~0.2-0.4 ms whatever its
size, which buckets pay once per length class (benchmarks/packing.py, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "BUCKET_RATIO",
    "AttentionBucket",
    "PackedLayout",
    "bucketed_attention",
    "pack",
    "packed_attention",
    "uses_varlen_kernel",
    "varlen_attention",
]

# A bucket holds sequences at least 1/BUCKET_RATIO as long as its longest: its padded causal SDPA
# computes at most BUCKET_RATIO² = 2x the scores of its sequences alone, and lengths from m to M
# take about log_√2(M / m) buckets (on CPU a per-sequence SDPA call costs ~6x a single padded
# call for 32 sequences of 6-10 tokens, and buckets are within 6% of it on long-tailed lengths).
BUCKET_RATIO = 2**0.5


class AttentionBucket(NamedTuple):
    """Sequences of similar length, attended in one right-padded call [count, length].

    Fields: ``count``, ``length`` (its longest) as ints; ``tokens`` Long[n], the stream indices
    of its real tokens; ``slots`` Long[n], their places in the flattened ``[count · length]``
    (sequence j of the bucket at ``j·length + position``).
    """

    count: int
    length: int
    tokens: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class PackedLayout:
    """Where the real tokens of a padded batch ``[b, S]`` sit in a packed stream of N tokens.

    Fields (device tensors on the model's device, host values as Python ints):
        shape:       (b, S), the padded shape
        rows, cols:  Long[N], the padded position ``[rows[i], cols[i]]`` of stream token i
                     (row-major: sequence after sequence, each in column order)
        positions:   Long[N], the position of each stream token in its sequence (0 at its first)
        cu_seqlens:  Int32[b + 1], stream offset of each sequence; sequence i is
                     ``[cu_seqlens[i], cu_seqlens[i + 1])``
        seq_lens:    tuple of the b lengths Lᵢ (host)
        max_seqlen:  max Lᵢ (host)
        start:       the first scored column (``ScoreSpec.start``; P for a rollout batch), or None
        score_src:   Long[n], the stream index of the hidden state that predicts each scored token
                     (a real token at column >= start; it is stream token ``score_src + 1``)
        score_rows, score_cols: Long[n], its place in the response-aligned ``[b, S - start]``
        buckets:     the :class:`AttentionBucket` s of :func:`bucketed_attention`
        bucket_order: Long[N], where stream token i is in the concatenation of the buckets' tokens
    """

    shape: tuple[int, int]
    rows: torch.Tensor
    cols: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: tuple[int, ...]
    max_seqlen: int
    start: int | None = None
    score_src: torch.Tensor | None = None
    score_rows: torch.Tensor | None = None
    score_cols: torch.Tensor | None = None
    buckets: tuple[AttentionBucket, ...] = ()
    bucket_order: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PackedLayout:
        """The same layout with its tensors on ``device`` (copied without waiting for it)."""
        return self.apply(lambda t: t.to(device, non_blocking=True))

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedLayout:
        """The same layout with ``fn`` of each of its tensors (the buckets' included)."""
        tensors = {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        buckets = tuple(b._replace(tokens=fn(b.tokens), slots=fn(b.slots)) for b in self.buckets)
        return replace(self, **tensors, buckets=buckets)

    @property
    def num_tokens(self) -> int:
        """N, the real tokens of the stream."""
        return sum(self.seq_lens)

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded [b, S, ...]`` -> its real tokens ``[N, ...]`` in stream order."""
        return padded[self.rows, self.cols]

    def scatter(self, stream: torch.Tensor) -> torch.Tensor:
        """``stream [N, ...]`` -> ``[b, S, ...]``, zeros at padding (a fresh tensor, no view)."""
        out = stream.new_zeros(*self.shape, *stream.shape[1:])
        return out.index_put((self.rows, self.cols), stream)

    def scatter_scored(self, scored: torch.Tensor) -> torch.Tensor:
        """``scored [n]`` (one value per scored token) -> ``[b, S - start]``, zeros elsewhere."""
        if self.start is None:
            raise ValueError("this layout was packed without start: it has no scored tokens")
        out = scored.new_zeros(self.shape[0], self.shape[1] - self.start)
        return out.index_put((self.score_rows, self.score_cols), scored)

    def scored_flat_index(self) -> torch.Tensor:
        """Long[n], each scored token's index into the flattened (row-major) ``[b·(S − start)]``."""
        return self.score_rows * (self.shape[1] - self.start) + self.score_cols


def pack(
    attention_mask: torch.Tensor,
    *,
    start: int | None = None,
) -> PackedLayout:
    """The :class:`PackedLayout` of a padded batch, from its attention mask ``Bool[b, S]``.

    Pass a host (CPU) copy of the mask: the layout's indices are made on the host, and
    :meth:`PackedLayout.to` moves them without waiting for the device. A mask on an accelerator is
    copied to the host first, which waits for the device once, and its layout goes back there.

    Raises ValueError when a row has no real token, when a row's real tokens are not contiguous
    (the RolloutBatch layout keeps them so), or, with ``start``, when a row with tokens to score at
    columns >= start has no real token before ``start`` to predict the first of them.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be Bool[b, S], got {tuple(attention_mask.shape)}")
    mask = attention_mask.to("cpu", torch.bool)
    b, S = mask.shape
    lengths = mask.sum(1)
    first = mask.int().argmax(1)
    if bool((lengths == 0).any()):
        raise ValueError(f"rows {(lengths == 0).nonzero().flatten().tolist()} have no real token")
    last = S - 1 - mask.flip(1).int().argmax(1)
    holes = (last - first + 1) != lengths
    if bool(holes.any()):
        raise ValueError(
            f"rows {holes.nonzero().flatten().tolist()} have padding between real tokens; packing "
            "needs each row's real tokens contiguous (left-padded prompt, right-padded response)"
        )
    rows, cols = mask.nonzero(as_tuple=True)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    positions = cols - first[rows]
    seq_lens = tuple(int(n) for n in lengths.tolist())
    extra: dict[str, torch.Tensor | int] = {}
    if start is not None:
        if not 1 <= start < S:
            raise ValueError(f"start ({start}) must satisfy 1 <= start < S ({S})")
        s_rows, s_cols = mask[:, start:].nonzero(as_tuple=True)
        lonely = s_rows[first[s_rows] >= start].unique()
        if lonely.numel():
            raise ValueError(
                f"rows {lonely.tolist()} have no real token before column start={start} to "
                "predict their first scored token"
            )
        # stream index of the scored token (start + col), minus one: its predecessor
        src = cu[s_rows].long() + (start + s_cols - first[s_rows]) - 1
        extra = dict(start=start, score_src=src, score_rows=s_rows, score_cols=s_cols)

    buckets, order = _buckets(seq_lens)
    layout = PackedLayout(
        shape=(b, S),
        rows=rows,
        cols=cols,
        positions=positions,
        cu_seqlens=cu,
        seq_lens=seq_lens,
        max_seqlen=max(seq_lens),
        buckets=tuple(AttentionBucket(g, n, t, s) for g, n, t, s in buckets),
        bucket_order=order,
        **extra,
    )
    device = attention_mask.device
    return layout if device.type == "cpu" else layout.to(device)


def _buckets(
    seq_lens: tuple[int, ...],
) -> tuple[list[tuple[int, int, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Sequences grouped longest first: a new bucket starts at the first sequence shorter than
    its bucket's longest / BUCKET_RATIO. Returns the buckets (count, length, tokens, slots) and
    the inverse permutation from the stream to the buckets' concatenated tokens."""
    lengths = torch.tensor(seq_lens)
    offsets = lengths.cumsum(0) - lengths  # stream offset of each sequence
    groups: list[list[int]] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):  # stable: ties in order
        if not groups or seq_lens[i] * BUCKET_RATIO < seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    out = []
    for group in groups:
        members = torch.tensor(group)
        n = lengths[members]
        seq = torch.repeat_interleave(torch.arange(len(group)), n)  # the bucket's j of each token
        position = torch.arange(int(n.sum())) - (n.cumsum(0) - n)[seq]  # place in its sequence
        length = seq_lens[group[0]]
        out.append((len(group), length, offsets[members][seq] + position, seq * length + position))
    N = sum(seq_lens)
    order = torch.empty(N, dtype=torch.long)
    order[torch.cat([t for _, _, t, _ in out])] = torch.arange(N)
    return out, order


# ----------------------------------------------------------------------------------------------
# Attention over a packed stream: q [N, H, hd], k/v [N, H_kv, hd] (RoPE applied) -> [N, H, hd]


@torch.compiler.disable  # a Python loop over the buckets: eager inside a compiled block
def bucketed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout
) -> torch.Tensor:
    """Causal attention inside each sequence, bucket by bucket (the path of CPU tensors and of
    fp32 on CUDA): each bucket's sequences right-padded to ``[count, heads, length, hd]`` (zeros
    after each sequence), one causal SDPA (GQA native: query head h reads key/value head
    h // (H / H_kv)), its real rows taken back. A pad comes after every real token of its
    sequence, so no real query attends to one, and a pad query's output is dropped (its gradient
    is 0, so it sends none back)."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for b in layout.buckets:
        qb, kb, vb = (_right_padded(x, b) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(b.count * b.length, *q.shape[1:])[b.slots])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[layout.bucket_order]


def _right_padded(x: torch.Tensor, b: AttentionBucket) -> torch.Tensor:
    """The bucket's sequences of ``x [N, heads, hd]`` as ``[count, heads, length, hd]``, zeros
    after each sequence."""
    rows = x.new_zeros(b.count * b.length, *x.shape[1:]).index_put((b.slots,), x[b.tokens])
    return rows.view(b.count, b.length, *x.shape[1:]).transpose(1, 2)


def _torch_varlen_attn(*args, **kwargs) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(*args, **kwargs)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence of the stream in one varlen call (the CUDA path in
    bf16/fp16): ``kernel`` is ``torch.nn.attention.varlen.varlen_attn`` (flash attention), which
    takes the stream as ``[N, heads, hd]`` with ``cu_seqlens`` (int32) and the longest length,
    causal as the window (-1, 0), and GQA with ``enable_gqa`` (query head h reads key/value head
    h // (H / H_kv), as :func:`bucketed_attention`). ``kernel``: None for torch's; a test passes a
    CPU stand-in."""
    cu, n = layout.cu_seqlens, layout.max_seqlen
    kernel = _torch_varlen_attn if kernel is None else kernel
    return kernel(q, k, v, cu, cu, n, n, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])


def uses_varlen_kernel(q: torch.Tensor) -> bool:
    """Whether :func:`packed_attention` takes the varlen flash kernel for ``q``: CUDA tensors in
    bf16 or fp16 (the dtypes flash attention takes)."""
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout
) -> torch.Tensor:
    """Causal attention inside each sequence of a packed stream, ``q [N, H, hd]``, ``k, v
    [N, H_kv, hd]`` -> ``[N, H, hd]``: :func:`varlen_attention` where :func:`uses_varlen_kernel`,
    else :func:`bucketed_attention`."""
    if uses_varlen_kernel(q):
        return varlen_attention(q, k, v, layout)
    return bucketed_attention(q, k, v, layout)
