"""What ``Correction.prepare`` returns: fixed anchors, or proximal ones formed per minibatch.

Both share ``minibatch(rows, policy_logprobs) -> MinibatchCorrection`` and ``metrics()``, which is
computed when called (the weight statistics stay on the device until then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minippo.rl.correction.weights import Weights, WeightStats, loglinear_prox_weights
from minippo.rl.types import RolloutBatch


@dataclass
class MinibatchCorrection:
    """What the policy loss of one minibatch takes, all [b, R] and without grad.

    anchor_logprobs: float32 a_t;  weights: float32 w_t;  keep_mask: float32 k_t.
    """

    anchor_logprobs: torch.Tensor
    weights: torch.Tensor
    keep_mask: torch.Tensor


class CorrectionOutput:
    """What ``Correction.prepare`` returns for one step; shared by every epoch and minibatch.

    ``minibatch(rows, policy_logprobs)`` gives the tensors of the minibatch ``rows``;
    ``metrics()`` the step's ``correction/`` metrics, computed when called from ``stats`` (the
    weight statistics, on device) and ``info`` (values fixed at ``prepare``: method state,
    staleness, forward passes).
    """

    stats: WeightStats
    info: dict[str, float]

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        """Anchor, weights and keep-mask of the minibatch ``rows`` (default: all rows).

        Args:
            rows: Long[b] row indices or a slice into the step's batch.
            policy_logprobs: Float[b, R] log π_θ of those rows (detached here); used by methods
                whose anchor follows the current policy (``ProximalAnchors``), ignored otherwise.
        """
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """``{"correction/...": float}`` (one host sync)."""
        return {**self.stats.as_dict(), **self.info}


@dataclass
class FixedAnchors(CorrectionOutput):
    """Anchors, weights and keep-mask fixed for the whole step ([B, R], float32, no grad, 0 on
    padding): every method whose anchor does not follow the current policy."""

    anchor_logprobs: torch.Tensor
    weights: torch.Tensor
    keep_mask: torch.Tensor
    stats: WeightStats
    info: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_weights(
        cls, batch: RolloutBatch, anchor: torch.Tensor, w: Weights, bound_kind: str = "truncated"
    ) -> FixedAnchors:
        """The output for anchor logprobs a ([B, R]) and their ``Weights``.

        Non-finite anchors are rejected by the weight functions (k = 0); here they are replaced by
        μ (by 0 where μ is not finite either) and pads get 0: no non-finite value leaves a
        correction. The weight statistics see the anchors before the replacement.
        """
        mask, mu = batch.response_mask, batch.rollout_logprobs.float()
        valid = mask > 0
        stats = WeightStats(bound_kind)
        stats.add(anchor, mu, mask, w)
        fallback = torch.where(valid & torch.isfinite(mu), mu, torch.zeros_like(mu))
        anchor = torch.where(torch.isfinite(anchor) & valid, anchor, fallback)
        return cls(anchor, w.weights, w.keep, stats)

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        rows = slice(None) if rows is None else rows
        return MinibatchCorrection(
            self.anchor_logprobs[rows], self.weights[rows], self.keep_mask[rows]
        )


@dataclass
class ProximalAnchors(CorrectionOutput):
    """loglinear_prox: α_t and μ_t fixed for the step ([B, R]); each ``minibatch`` call forms
    a_t = μ_t + α_t·(sg(log π_θ) − μ_t) and w_t = min(exp(a_t − μ_t), cap) from the current
    policy's logprobs, and adds its tokens to the weight statistics."""

    alpha: torch.Tensor
    rollout_logprobs: torch.Tensor
    response_mask: torch.Tensor
    cap: float
    stats: WeightStats = field(default_factory=WeightStats)
    info: dict[str, float] = field(default_factory=dict)

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        if policy_logprobs is None:
            raise ValueError(
                "loglinear_prox needs the minibatch's current logprobs: call "
                "out.minibatch(rows, policy_logprobs) with log π_θ of those rows"
            )
        rows = slice(None) if rows is None else rows
        mu, mask, alpha = self.rollout_logprobs[rows], self.response_mask[rows], self.alpha[rows]
        if policy_logprobs.shape != mu.shape:
            raise ValueError(
                f"policy_logprobs has shape {tuple(policy_logprobs.shape)}, expected "
                f"{tuple(mu.shape)} (the minibatch's [b, R])"
            )
        anchor, w = loglinear_prox_weights(policy_logprobs, mu, alpha, mask, cap=self.cap)
        self.stats.add(anchor, mu, mask, w)
        return MinibatchCorrection(anchor, w.weights, w.keep)
