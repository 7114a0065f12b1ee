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
parameters with the other ranks): the recipe takes the largest count over the ranks
(:func:`~minippo.parallel.all_reduce_floats` with ``max``), and each rank spreads its rows over
that count, which also balances the ranks' tokens per forward.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balance_tokens", "micro_batch_count"]


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
