"""What ``Correction.prepare`` returns: fixed anchors, or anchors that follow the current policy,
formed per minibatch from its logprobs (``PolicyAnchors``: ``CurrentAnchors``, ``ProximalAnchors``).

Both share ``minibatch(rows, policy_logprobs) -> MinibatchCorrection`` and ``metrics()``, which is
computed when called (the weight statistics stay on the device until then).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minippo.rl.correction.weights import Weights, WeightStats, loglinear_prox_weights
from minippo.rl.types import RolloutBatch

TokenAnchors = Callable[[torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""(lp Float32[n], sl) -> (anchor, weight, keep) Float32[n] of the tokens ``sl`` of a minibatch's
flattened (row-major) ``[b·R]`` tokens, from their detached current logprobs ``lp``."""


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
    follows_policy: bool = True  # minibatch needs the current logprobs of its rows

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

    def token_anchors(self, rows: torch.Tensor | slice | None = None) -> TokenAnchors | None:
        """The anchors of the minibatch ``rows`` as a function of each token's own current
        logprob, for the fused policy loss to form chunk by chunk; None when they are not formed
        token by token (fixed anchors, or weights that need whole rows)."""
        return None


def finite_anchor(anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``anchor`` with its non-finite entries replaced by μ (by 0 where μ is not finite either)
    and 0 on padding: no non-finite value leaves a correction (the weight functions have already
    rejected such tokens, k = 0)."""
    valid = mask > 0
    fallback = torch.where(valid & torch.isfinite(mu), mu, torch.zeros_like(mu))
    return torch.where(torch.isfinite(anchor) & valid, anchor, fallback)


@dataclass
class FixedAnchors(CorrectionOutput):
    """Anchors, weights and keep-mask fixed for the whole step ([B, R], float32, no grad, 0 on
    padding): every method whose anchor does not follow the current policy."""

    follows_policy = False
    anchor_logprobs: torch.Tensor
    weights: torch.Tensor
    keep_mask: torch.Tensor
    stats: WeightStats
    info: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_weights(
        cls, batch: RolloutBatch, anchor: torch.Tensor, w: Weights, bound_kind: str = "truncated"
    ) -> FixedAnchors:
        """The output for anchor logprobs a ([B, R]) and their ``Weights``; the weight statistics
        see the anchors before non-finite ones are replaced (``finite_anchor``)."""
        mask, mu = batch.response_mask, batch.rollout_logprobs.float()
        stats = WeightStats(bound_kind)
        stats.add(anchor, mu, mask, w)
        return cls(finite_anchor(anchor, mu, mask), w.weights, w.keep, stats)

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        rows = slice(None) if rows is None else rows
        return MinibatchCorrection(
            self.anchor_logprobs[rows], self.weights[rows], self.keep_mask[rows]
        )


class PolicyAnchors(CorrectionOutput):
    """Anchors that follow the current policy: each ``minibatch(rows, policy_logprobs)`` call forms
    a_t and w_t from sg(log π_θ) of those rows and adds their tokens to the weight statistics.

    A subclass implements ``_form(lp, mu, mask, **inputs) -> (anchor, Weights)`` on per-token
    tensors (its own ``[B, R]`` inputs come from ``_inputs()``). When every token's anchor and
    weight depend on that token alone (``tokenwise``), ``token_anchors(rows)`` hands the same
    function to the fused policy loss, which forms them chunk by chunk inside its one pass.
    """

    tokenwise: bool = True

    def __init__(
        self,
        rollout_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        bound_kind: str = "truncated",
        info: dict[str, float] | None = None,
    ):
        self.rollout_logprobs = rollout_logprobs
        self.response_mask = response_mask
        self.stats = WeightStats(bound_kind)
        self.info = {} if info is None else info

    def _inputs(self) -> dict[str, torch.Tensor]:
        """The subclass's own per-token ``[B, R]`` inputs of ``_form`` (besides μ and the mask)."""
        return {}

    def _form(
        self, lp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, Weights]:
        raise NotImplementedError

    def _tensors(self, rows: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        t = {"mu": self.rollout_logprobs, "mask": self.response_mask, **self._inputs()}
        return {k: v[rows] for k, v in t.items()}

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        if policy_logprobs is None:
            raise ValueError(
                f"{type(self).__name__}: the anchor follows the current policy, so minibatch needs "
                "its logprobs: call out.minibatch(rows, policy_logprobs) with log π_θ of those rows"
            )
        t = self._tensors(slice(None) if rows is None else rows)
        if policy_logprobs.shape != t["mu"].shape:
            raise ValueError(
                f"policy_logprobs has shape {tuple(policy_logprobs.shape)}, expected "
                f"{tuple(t['mu'].shape)} (the minibatch's [b, R])"
            )
        anchor, w = self._form(policy_logprobs.detach().float(), **t)
        self.stats.add(anchor, t["mu"], t["mask"], w)
        return MinibatchCorrection(finite_anchor(anchor, t["mu"], t["mask"]), w.weights, w.keep)

    def token_anchors(self, rows: torch.Tensor | slice | None = None) -> TokenAnchors | None:
        """The anchors of the minibatch ``rows`` token by token (None unless ``tokenwise``); the
        weight statistics are not touched: call ``minibatch`` with the pass's logprobs for them."""
        if not self.tokenwise:
            return None
        flat = {
            k: v.reshape(-1)
            for k, v in self._tensors(slice(None) if rows is None else rows).items()
        }

        def anchors(lp: torch.Tensor, sl: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            t = {k: v[sl] for k, v in flat.items()}
            anchor, w = self._form(lp.detach().float(), **t)
            return finite_anchor(anchor, t["mu"], t["mask"]), w.weights, w.keep

        return anchors


class CurrentAnchors(PolicyAnchors):
    """anchor = sg(log π_θ) of the very forward that trains (no scoring pass), weights
    ``weight_fn(anchor, μ, mask)``. Exact when the step makes one optimizer update: every
    micro-batch's forward then runs at the step-start weights, which is the anchor (``tis``).
    ``tokenwise``: the weight of a token depends on that token alone (token-level weights)."""

    def __init__(
        self,
        rollout_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
        weight_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Weights],
        *,
        tokenwise: bool,
        bound_kind: str = "truncated",
        info: dict[str, float] | None = None,
    ):
        super().__init__(rollout_logprobs, response_mask, bound_kind=bound_kind, info=info)
        self.weight_fn, self.tokenwise = weight_fn, tokenwise

    def _form(
        self, lp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, Weights]:
        return lp, self.weight_fn(lp, mu, mask)


class ProximalAnchors(PolicyAnchors):
    """loglinear_prox: α_t and μ_t fixed for the step ([B, R]); each ``minibatch`` call forms
    a_t = μ_t + α_t·(sg(log π_θ) − μ_t) and w_t = min(exp(a_t − μ_t), cap) from the current
    policy's logprobs (token by token)."""

    def __init__(
        self,
        alpha: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
        cap: float,
        *,
        info: dict[str, float] | None = None,
    ):
        super().__init__(rollout_logprobs, response_mask, info=info)
        self.alpha, self.cap = alpha, cap

    def _inputs(self) -> dict[str, torch.Tensor]:
        return {"alpha": self.alpha}

    def _form(
        self, lp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, Weights]:
        return loglinear_prox_weights(lp, mu, inputs["alpha"], mask, cap=self.cap)
