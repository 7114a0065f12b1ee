"""Learning-rate schedules (``torch.optim.lr_scheduler.LambdaLR``), stepped once per training step."""

from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger(__name__)
_SHORT_RUNS_TOLD: set[int] = set()


def _told(total_steps: int) -> bool:
    """Whether this process has already warned about a run of ``total_steps`` (then True)."""
    told = total_steps in _SHORT_RUNS_TOLD
    _SHORT_RUNS_TOLD.add(total_steps)
    return told


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 1.0,
) -> LambdaLR:
    """Linear warm-up, then a cosine decay to ``min_lr_ratio`` x lr at ``total_steps``.

    factor(s) = (s + 1) / warmup_steps                                  for s < warmup_steps
    factor(s) = r + (1 - r) * (1 + cos(pi * p)) / 2,  p = (s - w) / (total - w)   afterwards
    With the default ``min_lr_ratio = 1`` the lr is constant after the warm-up. A run with
    ``total_steps <= warmup_steps`` ends inside the warm-up (a warning says so).

    Args:
        optimizer: the optimizer whose lr is scaled.
        warmup_steps: steps of linear warm-up (0: none).
        total_steps: the step at which the decay ends (required when min_lr_ratio < 1).
        min_lr_ratio: the final lr as a fraction of the initial one, in [0, 1].
    """
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if min_lr_ratio < 1.0 and total_steps is None:
        raise ValueError(
            "lr_scheduler.total_steps is needed for a decay (min_lr_ratio < 1); "
            "set total_steps=${total_steps}"
        )
    if total_steps is not None and 0 < total_steps <= warmup_steps and not _told(total_steps):
        # a short run (a smoke test, total_steps=4) ends inside the warm-up: no decay, and said
        # so once (the actor's and the critic's schedules are built alike)
        log.warning(
            "lr_scheduler.total_steps=%d <= warmup_steps=%d: the run ends inside the warm-up, "
            "at %d/%d of the peak lr",
            total_steps,
            warmup_steps,
            total_steps,
            warmup_steps,
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if min_lr_ratio >= 1.0:
            return 1.0
        p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return LambdaLR(optimizer, factor)
