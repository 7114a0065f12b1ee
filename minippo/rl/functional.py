"""Masked statistics over response-aligned tensors.

Conventions: ``mask`` is a ``[B, R]`` (or any shape matching ``x``) tensor that is 1.0 on real
response tokens and 0.0 on padding; it is read as a boolean (``mask > 0``), so masked-out entries
never enter a sum even when they hold ``inf`` or ``nan``.

Why ``torch.distributed`` is imported here: ``masked_whiten`` normalises with the statistics of
all ranks (Σx, Σx², n all-reduced) when a process group exists, so that whitened advantages do not
depend on how the batch is split over ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Log-ratios are clamped to ±LOG_RATIO_CLAMP before exp: exp(±20) ∈ [2.1e-9, 4.9e8], finite in
# float32 and far outside any clip range. Gradient through the clamp is 0 beyond the bound.
LOG_RATIO_CLAMP = 20.0


def _check_same_shape(x: torch.Tensor, mask: torch.Tensor, x_name: str = "x") -> None:
    if x.shape != mask.shape:
        raise ValueError(
            f"{x_name} has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}; "
            "they must match (response-aligned [B, R])"
        )


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x over the entries where mask > 0 (all entries, or along ``dim``).

    Masked-out entries are replaced by 0 before summing, so a ``nan`` there does not leak.
    """
    _check_same_shape(x, mask)
    x = torch.where(mask > 0, x, 0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the entries where mask > 0.

    mean = Σ m·x / max(Σ m, 1): an empty selection gives 0 (finite), never ``nan``.
    """
    valid = mask > 0
    count = valid.sum() if dim is None else valid.sum(dim)  # exact integers: the same quotient
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all entries where mask > 0 (a scalar).

    var = Σ m·(x − mean)² / (n − 1)   (unbiased, Bessel's correction) or / n (biased),
    with n = Σ m; the denominator is floored at 1, so n ≤ 1 gives variance 0.
    """
    mean = masked_mean(x, mask)
    n = masked_sum(torch.ones_like(x), mask)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = n - 1 if unbiased else n
    return sq / denom.clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: Any = None,
) -> torch.Tensor:
    """Whiten x over the masked entries: (x − mean) / sqrt(var + eps); 0 on masked-out entries.

    With ``shift_mean=False`` the mean is added back, (x − mean) / sqrt(var + eps) + mean: only
    the spread is normalised, the mean (and so the sign balance) is kept. var is the unbiased
    masked variance. When a process group is initialised (``group``: None = the default group),
    mean and variance are over the entries of ALL ranks (Σx, Σx², n all-reduced), so every rank
    whitens with the full batch's statistics and the result does not depend on the world size.
    """
    if dist.is_available() and dist.is_initialized():
        valid = mask > 0
        xv = torch.where(valid, x, 0.0)
        # [Σ m·x, Σ m·x², Σ m] over every rank
        sums = torch.stack([xv.sum(), (xv * xv).sum(), valid.sum().to(x.dtype)]).double()
        dist.all_reduce(sums, group=group)
        s1, s2, n = sums.unbind()
        mean = s1 / n.clamp(min=1)
        var = (s2 - n * mean * mean) / (n - 1).clamp(min=1)  # unbiased
        mean, var = mean.to(x.dtype), var.clamp(min=0).to(x.dtype)
    else:
        mean = masked_mean(x, mask)
        var = masked_var(x, mask)
    white = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(mask > 0, white, 0.0)
