"""Learning-rate schedules (``torch.optim.lr_scheduler.LambdaLR``), stepped once per training step."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


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
    With the default ``min_lr_ratio = 1`` the lr is constant after the warm-up.

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
    if min_lr_ratio < 1.0 and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"lr_scheduler.total_steps ({total_steps}) must be > warmup_steps ({warmup_steps}) "
            "for a decay; set total_steps=${total_steps}"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if min_lr_ratio >= 1.0:
            return 1.0
        p = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return LambdaLR(optimizer, factor)
