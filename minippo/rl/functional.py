"""Masked statistics and entropy helpers.

Conventions: ``mask`` is a ``[B, R]`` (or any shape matching ``x``) tensor that is 1.0 on real
response tokens and 0.0 on padding; it is read as a boolean (``mask > 0``), so masked-out entries
never enter a sum even when they hold ``inf`` or ``nan``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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
    x = torch.where(mask > 0, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the entries where mask > 0.

    mean = Σ m·x / max(Σ m, 1): an empty selection gives 0 (finite), never ``nan``.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
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
        xv = torch.where(valid, x, torch.zeros_like(x))
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
    return torch.where(mask > 0, white, torch.zeros_like(white))


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the sampled distribution p = softmax(logits / T), in nats.

    Args:
        logits: float [..., V]
        temperature: T > 0, the sampling temperature (the engine samples from softmax(z / T)).
    Returns:
        float32 [...]: H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v, with z = logits / T,
        computed in float32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define a distribution, got {temperature}")
    z = logits.float() / temperature
    logp = F.log_softmax(z, dim=-1)
    p = logp.exp()
    # H = −Σ p log p, with 0·log 0 = 0 (logits of −inf, e.g. banned tokens, give no nan)
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def _entropy_of_chunk(hidden: torch.Tensor, weight: torch.Tensor, temperature: float):
    # logits = h · Wᵀ, in float32; only this chunk's [B, C, V] logits exist at once
    logits = hidden.float() @ weight.float().t()
    return entropy_from_logits(logits, temperature)


def chunked_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Entropy of softmax(h · Wᵀ / T) at each position, computed chunk by chunk over the sequence.

    The full ``[B, S, V]`` float32 logits never live at once: each chunk of ``chunk_size``
    positions is projected, reduced to its entropy and dropped. When gradients are needed the
    chunk is wrapped in activation checkpointing, so backward recomputes that chunk's logits
    instead of keeping them.

    Args:
        hidden: float [B, S, D] final-normed hidden states. For response entropies pass the
            positions whose logits predict the response tokens, ``hidden[:, P - 1 : P + R - 1]``,
            which gives a response-aligned ``[B, R]`` result.
        lm_head_weight: float [V, D], the full (unsharded) output projection.
        temperature: T > 0, the sampling temperature.
        chunk_size: positions per chunk (> 0).
    Returns:
        float32 [B, S]
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, S, D], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight must be [V, D] with D = {hidden.shape[2]}, "
            f"got shape {tuple(lm_head_weight.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define a distribution, got {temperature}")
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    out = []
    for start in range(0, hidden.shape[1], chunk_size):
        h = hidden[:, start : start + chunk_size]
        if need_grad:
            out.append(
                checkpoint(_entropy_of_chunk, h, lm_head_weight, temperature, use_reentrant=False)
            )
        else:
            out.append(_entropy_of_chunk(h, lm_head_weight, temperature))
    if not out:
        return hidden.new_zeros(hidden.shape[:2], dtype=torch.float32)
    return torch.cat(out, dim=1)
