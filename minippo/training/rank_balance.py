"""Whole prompt groups moved between ranks, so that every rank trains on nearly as many tokens.

Each rank's engine samples its own groups. With long-tailed response lengths one rank's batch can
hold twice the tokens of another's, and under FSDP every forward waits for the slowest rank (each
one all-gathers parameters with all the others): the step takes as long as the heaviest rank's
share. So before the no-grad passes of a step (``ppo.balance_ranks``, on by default):

- :func:`assign_groups` gives each rank as many groups as it sampled (its rows, minibatches and
  micro-batch settings stay as configured), the heaviest group first, each into the rank with the
  fewest tokens that still has room (ties: the lower rank);
- :func:`balance_over_ranks` gathers every rank's rows (one all-gather per field, each rank's rows
  padded to the widest prompt and response of any rank) and keeps the rows of its own groups.

Whole groups move, so GRPO's group statistics stay on one rank. The losses are shares of the
global token and sequence counts, so the objective does not depend on which rank trains a row;
which rows a rank holds changes only the rounding of the gradient sum. A group's weight is its
real tokens (prompt + response: what a packed forward computes on). The exchange is a function of
every rank's batch alone, so a resumed run balances exactly as an uninterrupted one. Its memory
is transient, before the passes: one field of every rank's batch twice (gathered and stacked;
the 8-GPU config: 512 rows x 5120 int64 tokens, 2 x 20 MiB).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from minippo.rl.types import RolloutBatch

__all__ = ["assign_groups", "balance_over_ranks"]


def assign_groups(tokens: Sequence[int], capacity: Sequence[int]) -> list[list[int]]:
    """Per rank, the indices (ascending) of the groups it trains: rank r gets ``capacity[r]``
    of them; the heaviest group first, each into the rank with the fewest tokens so far among
    those with room (ties: the lower rank).

    Args:
        tokens:   the tokens of every group (>= 0)
        capacity: groups per rank; they add up to ``len(tokens)``
    """
    if sum(capacity) != len(tokens) or min(capacity, default=0) < 0:
        raise ValueError(
            f"capacities {list(capacity)} must be >= 0 and add up to the {len(tokens)} groups"
        )
    load = [0] * len(capacity)
    groups: list[list[int]] = [[] for _ in capacity]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        room = [r for r in range(len(capacity)) if len(groups[r]) < capacity[r]]
        r = min(room, key=lambda r: (load[r], r))
        groups[r].append(i)
        load[r] += tokens[i]
    return [sorted(g) for g in groups]


def balance_over_ranks(
    batch: RolloutBatch, device: torch.device | str
) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's rows after moving whole groups between ranks (:func:`assign_groups`), on
    ``device`` (where the backend's collectives run: the accelerator under NCCL), and the
    ranks' balance before and after as metrics. Collective: every rank calls it with a batch of
    as many rows. A single process gets its batch back (on ``device``) and no metrics.

    The returned rows: the groups of the lower source rank first, each group's rows in their
    order; group ids renumbered 0, 1, ... in that order; every row padded to the widest prompt
    and response of any rank (:meth:`RolloutBatch.padded_to`).

    Metrics (the same on every rank): ``perf/rank_tokens_max_over_mean`` (the heaviest rank's
    real tokens over the mean, after balancing; 1.0 is even) and ``..._sampled`` (as sampled).
    """
    batch = batch.to(device)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return batch, {}
    rank = dist.get_rank()
    B, R = batch.batch_size, batch.response_mask.shape[1]

    # every rank's shape, then its rows' tokens and groups
    shapes = _all_gather(torch.tensor([B, batch.prompt_len, R], device=device)).tolist()
    if any(rows != B for rows, _, _ in shapes):
        raise RuntimeError(
            f"balance_over_ranks: every rank needs as many rows; got {[s[0] for s in shapes]}"
        )
    lengths = batch.attention_mask.sum(1)
    per_row = _all_gather(torch.stack([lengths, batch.group_ids])).tolist()  # [world][2][B]
    groups: list[list[int]] = []  # global row indices (rank * B + row) of each group
    capacity = []
    for r, (_, gids) in enumerate(per_row):
        first: dict[int, list[int]] = {}
        for i, g in enumerate(gids):
            first.setdefault(g, []).append(r * B + i)
        groups.extend(first.values())
        capacity.append(len(first))
    tokens = [sum(per_row[i // B][0][i % B] for i in g) for g in groups]
    mine = assign_groups(tokens, capacity)

    rows = torch.tensor([i for g in mine[rank] for i in groups[g]], device=device)
    new_ids = torch.tensor([k for k, g in enumerate(mine[rank]) for _ in groups[g]], device=device)
    wide = batch.padded_to(max(s[1] for s in shapes), max(s[2] for s in shapes))
    moved = {
        name: _all_gather(getattr(wide, name)).flatten(0, 1)[rows]
        for name in RolloutBatch.__dataclass_fields__
    }
    moved["group_ids"] = new_ids
    loads = [sum(tokens[g] for g in gs) for gs in mine]
    sampled = [sum(row[0]) for row in per_row]
    metrics = {
        "perf/rank_tokens_max_over_mean": _max_over_mean(loads),
        "perf/rank_tokens_max_over_mean_sampled": _max_over_mean(sampled),
    }
    return RolloutBatch(**moved), metrics


def _all_gather(t: torch.Tensor) -> torch.Tensor:
    """``[world, *t.shape]``: every rank's ``t`` (bool travels as uint8: not every backend
    reduces bools)."""
    send = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
    out = [torch.empty_like(send) for _ in range(dist.get_world_size())]
    dist.all_gather(out, send)
    return torch.stack(out).to(t.dtype)


def _max_over_mean(loads: Sequence[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
