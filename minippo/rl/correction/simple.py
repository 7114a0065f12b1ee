"""The corrections that keep no weights: rollout_logprobs, tis, loglinear_prox and none."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from minippo.rl.correction.base import Correction, WeightCopies, number, one_of
from minippo.rl.correction.outputs import CurrentAnchors, FixedAnchors, ProximalAnchors
from minippo.rl.correction.weights import (
    TIS_LEVELS,
    TIS_MODES,
    Weights,
    discrepancy_weights,
    loglinear_alpha,
    truncated_is_weights,
)
from minippo.rl.types import RolloutBatch


def cap_at_least_one(owner: type, o: dict[str, Any]) -> None:
    """cap, the ratio's upper bound, must be >= 1: a cap below 1 would cut the weight of tokens
    whose ratio is exactly 1 (sampled by the anchor's own weights) as if they were off-policy."""
    if number(owner, "cap", o["cap"]) < 1:
        raise ValueError(
            f"correction.cap must be >= 1 (a ratio of 1 is on-policy and must keep its weight), "
            f"got cap={o['cap']} ({owner.__name__}); e.g. correction.cap=2.0"
        )


class _NoStoredWeights(Correction):
    """A correction that keeps no weight copies and scores the actor ``passes`` times a step."""

    passes = 0

    @classmethod
    def stored_weights(
        cls, *, max_staleness: int, partial_rollout: bool, **options: Any
    ) -> list[WeightCopies]:
        return []

    @classmethod
    def scoring_passes(cls, *, max_staleness: int, **options: Any) -> int:
        return cls.passes


class RolloutLogprobs(_NoStoredWeights):
    """anchor = the engine's logprobs μ; no extra forward; the PPO clip absorbs train/inference
    discrepancy and staleness together.

    a_t = μ_t, w_t = 1; a non-finite μ_t rejects its token.
    """

    method = "rollout_logprobs"

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        tis = {k: v for k, v in options.items() if k in TIS.defaults() and k not in cls.defaults()}
        if tis:
            given = ", ".join(f"{k}={v!r}" for k, v in tis.items())
            raise ValueError(
                "correction RolloutLogprobs uses the engine logprobs as the anchor and is "
                f"incompatible with tis options ({given}); for truncated importance sampling set "
                "correction._component_=minippo.rl.correction.TIS"
            )
        return super().check(**options)

    passes = 0  # extra no-grad forward passes of the actor per step

    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> FixedAnchors:
        mu, mask = batch.rollout_logprobs.float(), batch.response_mask
        valid = mask > 0
        ok = valid & torch.isfinite(mu)  # a non-finite μ is rejected (and counted), like elsewhere
        none = torch.zeros_like(valid)
        w = Weights(ok.float(), ok.float(), none, none, valid & ~ok)
        return FixedAnchors.from_weights(batch, torch.where(ok, mu, 0.0), w)


class NoCorrection(_NoStoredWeights):
    """anchor = the current weights at the step start (w = 1): synchronous PPO; it does not
    correct for the policy that sampled the tokens.

    What an absent or null ``correction`` means. One forward per step.
    """

    method = "none"
    corrects_behaviour_policy = False

    passes = 1  # extra no-grad forward passes of the actor per step

    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> FixedAnchors:
        anchor = self.score(actor, batch)
        w = discrepancy_weights(
            anchor, batch.rollout_logprobs.float(), batch.response_mask, cap=None
        )
        return FixedAnchors.from_weights(batch, anchor, w)


class TIS(_NoStoredWeights):
    """anchor = the trainer's weights at the step start; truncated (or masked) importance weights
    exp(anchor − μ); one forward per step, none when the step makes one optimizer update.

    With ``updates_per_step == 1`` every micro-batch's forward runs at the step-start weights, so
    the anchor is the detached logprob of the training forward itself (``CurrentAnchors``, the
    case verl calls on-policy): no scoring pass. Otherwise one no-grad forward at the step start
    scores the batch (``FixedAnchors``).

    Args: level ("token" | "sequence" | "geometric"), mode ("truncate" | "mask"), low (≥ 0),
    cap (> low), plus the arguments of ``Correction``.
    """

    method = "tis"

    def __init__(
        self,
        *,
        level: str = "token",
        mode: str = "truncate",
        low: float = 0.0,
        cap: float = 2.0,
        **provided: Any,
    ):
        super().__init__(level=level, mode=mode, low=low, cap=cap, **provided)
        self.level, self.mode, self.low, self.cap = level, mode, float(low), float(cap)

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        o = super().check(**options)
        one_of(cls, "level", o["level"], TIS_LEVELS)
        one_of(cls, "mode", o["mode"], TIS_MODES)
        cap_at_least_one(cls, o)
        low, cap = number(cls, "low", o["low"]), float(o["cap"])
        if low >= cap:
            raise ValueError(
                f"TIS: low ({low}) must be < cap ({cap}); lower correction.low or raise "
                "correction.cap"
            )
        if not 0 <= low <= 1:
            raise ValueError(
                f"correction.low must be in [0, 1] (a ratio of 1 is on-policy and must keep its "
                f"weight), got low={low} (TIS); e.g. correction.low=0.0"
            )
        return o

    passes = 1  # extra no-grad forward passes of the actor per step, worst case (0 on one update)

    def compute(
        self, batch: RolloutBatch, actor: nn.Module, step: int
    ) -> FixedAnchors | CurrentAnchors:
        weight_fn = partial(
            truncated_is_weights, level=self.level, mode=self.mode, low=self.low, cap=self.cap
        )
        kind = "masked" if self.mode == "mask" else "truncated"
        mu, mask = batch.rollout_logprobs.float(), batch.response_mask
        if self.updates_per_step == 1:
            tokenwise = self.level == "token"
            return CurrentAnchors(mu, mask, weight_fn, tokenwise=tokenwise, bound_kind=kind)
        anchor = self.score(actor, batch)
        return FixedAnchors.from_weights(batch, anchor, weight_fn(anchor, mu, mask), kind)


class LogLinearProx(_NoStoredWeights):
    """A-3PO baseline: anchor = μ + α·(sg(log π_θ) − μ), α fixed per step; no extra forward.

    The anchor follows the current policy by definition, so ``prepare`` fixes α and μ for the
    step and ``ProximalAnchors.minibatch(rows, policy_logprobs)`` forms a and w per minibatch.
    Args: cap (> 0), plus the arguments of ``Correction``.
    """

    method = "loglinear_prox"

    def __init__(self, *, cap: float = 2.0, **provided: Any):
        super().__init__(cap=cap, **provided)
        self.cap = float(cap)

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        o = super().check(**options)
        cap_at_least_one(cls, o)
        return o

    passes = 0  # extra no-grad forward passes of the actor per step

    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> ProximalAnchors:
        mask = batch.response_mask
        alpha = loglinear_alpha(batch.versions, mask, step)
        a = alpha[mask > 0]
        info = {
            "correction/alpha_mean": float(a.mean()) if a.numel() else 0.0,
            "correction/alpha_max": float(a.max()) if a.numel() else 0.0,
        }
        return ProximalAnchors(alpha, batch.rollout_logprobs.float(), mask, self.cap, info=info)
