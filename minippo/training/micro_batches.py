"""Micro-batches by token budget: sequences grouped so that every forward carries nearly the same
number of real tokens.

A rollout batch is long-tailed: a micro-batch of a fixed number of rows holds a few hundred tokens
one time and tens of thousands the next. With packed passes (``minippo.models.packing``) the cost of
a forward is its real tokens, so the recipe groups a minibatch's rows by a token budget
(``ppo.max_tokens_per_micro_batch``): :func:`micro_batch_count` is the fewest groups that keep
every group within the budget, :func:`balance_tokens` spreads the rows over that many groups,
longest first into the lightest group (LPT), which keeps the largest group within 4/3 of the best
possible one. A sequence longer than the budget takes a group of its own.

Under FSDP every rank must run the same number of forwards (each forward all-gathers the
parameters with the other ranks): :func:`split_rows` takes the largest count over the ranks
(:func:`~minippo.parallel.max_over_ranks`), and each rank spreads its rows over that count
(:mod:`minippo.training.rank_balance` has already evened the ranks' tokens by moving groups).

The recipe plans its forwards here: :func:`update_plan` (the micro-batches of every optimizer step
of a training step, with their packed layouts, before the updates start) and
:func:`scored_in_forwards` (a no-grad pass over the batch: reference, critic values, anchors).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minippo.models.packing import PackedLayout

__all__ = ["balance_tokens", "micro_batch_count", "scored_in_forwards", "split_rows", "update_plan"]


def balance_tokens(lengths: Sequence[int], count: int) -> list[list[int]]:
    """``count`` groups of the indices of ``lengths``: longest first, each into the group with the
    fewest tokens so far (ties: the lower group). Each group's indices ascending; a group is empty
    only when there are fewer sequences than groups.

    Args:
        lengths: tokens of each sequence (ints >= 0)
        count:   groups (>= 1)
    """
    if count < 1:
        raise ValueError(f"count ({count}) must be >= 1")
    heap = [(0, g) for g in range(count)]  # (tokens so far, group)
    groups: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (tokens + lengths[i], g))
    return [sorted(g) for g in groups]


def micro_batch_count(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest groups :func:`balance_tokens` needs so that every group holds at most
    ``max_tokens`` tokens or a single sequence (one longer than the budget goes alone); at least
    1, at most ``len(lengths)``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    n = len(lengths)
    # a lower bound: one group per sequence over the budget (it holds nothing else), and the
    # others' tokens in groups of at most max_tokens
    over = sum(1 for x in lengths if x > max_tokens)
    rest = sum(x for x in lengths if x <= max_tokens)
    count = max(1, min(n, over + -(-rest // max_tokens)))
    while count < n:
        groups = balance_tokens(lengths, count)
        if all(len(g) <= 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups):
            break
        count += 1
    return count


def split_rows(
    row_sets: Sequence[torch.Tensor],
    lengths: torch.Tensor,
    *,
    max_tokens: int | None,
    max_rows: int | None,
    device: torch.device | str,
) -> list[list[torch.Tensor]]:
    """The forwards of each set of rows: at most ``max_tokens`` real tokens each, as many on every
    rank (one all-reduce for all the sets: call it on every rank), or ``max_rows`` rows each;
    both None: one forward per set.

    Args:
        row_sets: Long[n] row indices (CPU), e.g. the minibatches of a step
        lengths:  Long[B] (CPU), the real tokens of every row of the batch
        device:   where the all-reduce's tensor lives (the accelerator under NCCL)
    Returns: per set, its forwards as Long row indices (each forward's rows ascending).
    """
    from minippo.parallel import max_over_ranks

    if max_tokens is None:
        return [list(rows.split(max_rows or len(rows))) for rows in row_sets]
    per_set = [lengths[rows].tolist() for rows in row_sets]
    counts = max_over_ranks([micro_batch_count(n, max_tokens) for n in per_set], device)
    return [
        [rows[g] for g in balance_tokens(n, c)] for rows, n, c in zip(row_sets, per_set, counts)
    ]


def update_plan(
    host_mask: torch.Tensor,
    generator: torch.Generator,
    *,
    epochs: int,
    minibatches: int,
    max_tokens: int | None,
    max_rows: int | None,
    pack_start: int | None,
    device: torch.device | str,
) -> list[list[tuple[torch.Tensor, PackedLayout | None]]]:
    """The forwards of one step's PPO updates, planned on the host before they start: per
    optimizer step (``epochs`` x ``minibatches``, each epoch's rows shuffled by ``generator``)
    its micro-batches (:func:`split_rows`, collective under FSDP) as (rows, packed layout).

    Args:
        host_mask:  Bool[B, S] attention mask on the host (CPU)
        pack_start: the column of the first response token: each micro-batch gets its
                    :func:`~minippo.models.pack` layout on the host; None: padded (layout None)
    """
    from minippo.models import pack

    minibatch_rows = [
        rows
        for _epoch in range(epochs)
        for rows in torch.randperm(host_mask.shape[0], generator=generator).chunk(minibatches)
    ]
    micros = split_rows(
        minibatch_rows, host_mask.sum(1), max_tokens=max_tokens, max_rows=max_rows, device=device
    )
    if pack_start is None:
        return [[(rows, None) for rows in mbs] for mbs in micros]
    return [[(rows, pack(host_mask[rows], start=pack_start)) for rows in mbs] for mbs in micros]


def scored_in_forwards(
    fn: Callable[[Any, PackedLayout | None], torch.Tensor],
    batch: Any,
    *,
    max_tokens: int | None,
    max_rows: int | None,
    pack: bool,
    device: torch.device | str,
) -> torch.Tensor:
    """``fn(chunk, layout)`` of a no-grad pass over ``batch`` (a
    :class:`~minippo.rl.RolloutBatch`) in forwards of :func:`split_rows` (both limits None: the
    whole batch at once), concatenated back in row order. Every rank runs as many forwards, so
    FSDP's collectives line up. ``pack``: each forward gets its packed layout (made from the
    attention mask's host copy, one copy from the device per pass) on ``device``; else None.

    Returns: ``fn``'s outputs ``[B, ...]`` in the rows' order.
    """
    from minippo.models import pack as pack_layout

    host_mask = batch.attention_mask.cpu()
    (chunks,) = split_rows(
        [torch.arange(batch.batch_size)],
        host_mask.sum(1),
        max_tokens=max_tokens,
        max_rows=max_rows,
        device=device,
    )
    outs = []
    for rows in chunks:
        layout = pack_layout(host_mask[rows], start=batch.prompt_len) if pack else None
        outs.append(fn(batch.select(rows), None if layout is None else layout.to(device)))
    order = torch.cat(chunks)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return torch.cat(outs)[inverse.to(device)]
