"""KL estimators between the policy and a reference policy, from sampled-token logprobs.

With samples from π and d_t = log π_ref(t) − log π(t) (clamped to ±20 before use), each estimator
has expectation KL(π ‖ π_ref) under π (Schulman, "Approximating KL divergence", 2020):
    k1 = −d                 unbiased, high variance, can be negative per token
    k2 = d² / 2             biased, low variance, ≥ 0
    k3 = exp(d) − 1 − d     unbiased, low variance, ≥ 0
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minippo.rl.aggregation import aggregate
from minippo.rl.functional import LOG_RATIO_CLAMP, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")


class KLStats(NamedTuple):
    """Detached statistics of :func:`kl_loss` (0-dim float tensors; metric names ``train/<field>``).

    Fields:
        kl_loss  the returned loss value (this micro-batch's share, before the coefficient β)
        kl_mean  masked mean of kl_t over this micro-batch
    """

    kl_loss: torch.Tensor
    kl_mean: torch.Tensor


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate (differentiable through both inputs, unmasked).

    Args:
        logprobs: float [B, R], log π of the sampled tokens.
        ref_logprobs: float [B, R], log π_ref of the same tokens.
        kind: "k1", "k2" or "k3" (see the module docstring).
    Returns:
        float [B, R]
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; use one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape"
        )
    # d = log π_ref − log π, clamped to ±20 (exp(20) ≈ 4.9e8 stays finite in float32)
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return -d  # k1 = log π − log π_ref
    if kind == "k2":
        return 0.5 * d**2  # k2 = d² / 2
    return torch.expm1(d) - d  # k3 = exp(d) − 1 − d


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "k1",
) -> torch.Tensor:
    """Per-token KL for use as a reward penalty: r_t ← r_t − β·kl_t. No gradient.

    Args:
        logprobs, ref_logprobs: float [B, R]; response_mask: [B, R].
        kind: "k1", "k2" or "k3".
    Returns:
        float [B, R], detached, 0 on masked positions.
    """
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must match logprobs {tuple(logprobs.shape)}"
        )
    with torch.no_grad():
        kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), kind)
        return torch.where(response_mask > 0, kl, 0.0)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "k3",
    *,
    agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, KLStats]:
    """KL to the reference as a loss term (GRPO-style), with gradient through ``logprobs``.

    loss = aggregate(kl_t, m, agg_mode); the caller scales it by its coefficient β.

    Args:
        logprobs: float [B, R] (with grad); ref_logprobs: float [B, R] (detached here).
        response_mask: [B, R]; kind: "k1", "k2" or "k3".
        agg_mode, global_tokens, global_seqs: see ``aggregate``.
    Returns:
        loss: float scalar; stats: :class:`KLStats` (detached 0-dim tensors)
    """
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must match logprobs {tuple(logprobs.shape)}"
        )
    # padded positions get ref = log π (kl 0) so a non-finite value there cannot reach the gradient
    ref = torch.where(response_mask > 0, ref_logprobs.detach(), logprobs.detach())
    kl = kl_estimate(logprobs, ref, kind)
    loss = aggregate(
        kl, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs
    )
    stats = KLStats(kl_loss=loss.detach(), kl_mean=masked_mean(kl.detach(), response_mask))
    return loss, stats
