"""The per-token math of the corrections: pure functions on response-aligned ``[B, R]`` tensors.

Inputs: the anchor logprobs a (no grad), the engine's logprobs μ of the sampled tokens and the
response mask m (1.0 on response tokens). Every weight function starts from the same log-ratio,
``log_ratio(a, μ, m)``: d = a − μ with non-finite entries rejected, and ρ = exp(clamp(d, ±20)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minippo.rl.kl import kl_estimate
from minippo.rl.losses import LOG_RATIO_CLAMP  # log-ratios are clamped to ±20 before exp

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")


class Weights(NamedTuple):
    """Per-token output of a weight function, all [B, R].

    weights: float32 w_t (0 on pads and rejected tokens); keep: float32 k_t (0 on pads);
    high / low: bool, tokens whose ratio lay above the cap / below the lower bound (truncated or
    masked, depending on the method); nonfinite: bool, tokens rejected for a non-finite ratio.
    """

    weights: torch.Tensor
    keep: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    nonfinite: torch.Tensor


class LogRatio(NamedTuple):
    """The prelude of every weight function, all [B, R].

    valid: bool, m > 0;  finite: bool, valid and a − μ finite;  d: a − μ, 0 where not finite;
    rho: exp(clamp(d, ±20)).
    """

    valid: torch.Tensor
    finite: torch.Tensor
    d: torch.Tensor
    rho: torch.Tensor


def clamped_exp(log_rho: torch.Tensor) -> torch.Tensor:
    """exp(clamp(log ρ, ±20)): finite in float32 for any finite input."""
    return torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def log_ratio(anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> LogRatio:
    """d = a − μ and ρ = exp(clamp(d, ±20)) of the valid tokens; non-finite d is set to 0 (and
    left out of ``finite``) so that no NaN reaches a weight."""
    valid = mask > 0
    d = anchor - mu
    finite = torch.isfinite(d) & valid
    d = torch.where(finite, d, torch.zeros_like(d))
    return LogRatio(valid, finite, d, clamped_exp(d))


def truncated_is_weights(
    anchor: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    low: float = 0.0,
    cap: float = 2.0,
) -> Weights:
    """TIS weights from anchor a and engine logprobs μ, all [B, R].

        d_t = a_t − μ_t
        token:      log ρ_t = d_t
        sequence:   log ρ_t = Σ_s m_s d_s               (product of the token ratios)
        geometric:  log ρ_t = Σ_s m_s d_s / Σ_s m_s     (their geometric mean)
        ρ = exp(clamp(log ρ, ±20))
        truncate:   w = clamp(ρ, low, cap), k = 1
        mask:       w = ρ, k = 1 if low ≤ ρ ≤ cap else w = k = 0
    A non-finite d rejects its token (token level) or its whole sequence (other levels).
    """
    r = log_ratio(anchor, mu, mask)
    if level == "token":
        rho, ok = r.rho, r.finite
    else:
        row_ok = ~(r.valid & ~r.finite).any(dim=1, keepdim=True)
        s = (r.d * mask).sum(dim=1, keepdim=True)  # Σ m d
        if level == "geometric":
            s = s / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # Σ m d / Σ m
        elif level != "sequence":
            raise ValueError(f"tis level {level!r} is not one of {TIS_LEVELS}")
        rho = clamped_exp(s.expand_as(r.d))
        ok = r.valid & row_ok
    high = ok & (rho > cap)
    lo = ok & (rho < low)
    if mode == "truncate":
        keep = ok
        w = rho.clamp(min=low, max=cap)
    elif mode == "mask":
        keep = ok & ~high & ~lo
        w = rho
    else:
        raise ValueError(f"tis mode {mode!r} is not one of {TIS_MODES}")
    return Weights(torch.where(keep, w, 0.0), keep.float(), high, lo, r.valid & ~ok)


def discrepancy_weights(
    anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, *, cap: float | None = 2.0
) -> Weights:
    """keep_old_actor's train-vs-inference weight: w = clamp(exp(a − μ), 0, cap), k = 1.

    With ``cap=None`` the weight is 1. Non-finite ratios are rejected (w = k = 0).
    """
    r = log_ratio(anchor, mu, mask)
    if cap is None:
        w, high = torch.ones_like(r.rho), torch.zeros_like(r.finite)
    else:
        w, high = r.rho.clamp(max=cap), r.finite & (r.rho > cap)
    return Weights(
        torch.where(r.finite, w, 0.0),
        r.finite.float(),
        high,
        torch.zeros_like(high),
        r.valid & ~r.finite,
    )


def symmetric_mask_weights(
    anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0
) -> Weights:
    """EWMA's train-inference mask: keep ρ = exp(a − μ) in [1/c, c]; w = ρ on kept tokens, else 0."""
    r = log_ratio(anchor, mu, mask)
    high = r.finite & (r.rho > cap)
    lo = r.finite & (r.rho < 1.0 / cap)
    keep = r.finite & ~high & ~lo
    return Weights(torch.where(keep, r.rho, 0.0), keep.float(), high, lo, r.valid & ~r.finite)


def loglinear_alpha(versions: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
    """A-3PO interpolation coefficient, Float32[B, R] (0 on pads).

    α_t = clamp((v_k − 1 − v_t) / (v_k − v_t), 0, 1),  α_t = 0 when v_k = v_t;  v_k = step
    """
    lag = (step - versions).to(torch.float32)  # v_k − v_t
    alpha = ((lag - 1.0) / lag.clamp(min=1.0)).clamp(0.0, 1.0)
    return torch.where((mask > 0) & (lag > 0), alpha, torch.zeros_like(alpha))


def loglinear_prox_weights(
    policy_logprobs: torch.Tensor,
    mu: torch.Tensor,
    alpha: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
) -> tuple[torch.Tensor, Weights]:
    """Anchor and weights of loglinear_prox from the current policy's logprobs (detached).

        a_t = μ_t + α_t·(sg(log π_θ) − μ_t),   w_t = min(exp(a_t − μ_t), cap),   k_t = 1
    Returns (anchor [B, R] with 0 on pads, Weights).
    """
    anchor = mu + alpha * (policy_logprobs.detach().float() - mu)
    r = log_ratio(anchor, mu, mask)
    high = r.finite & (r.rho > cap)
    anchor = torch.where(r.finite, anchor, torch.where(r.valid, mu, 0.0))
    w = torch.where(r.finite, r.rho.clamp(max=cap), 0.0)
    return anchor, Weights(w, r.finite.float(), high, torch.zeros_like(high), r.valid & ~r.finite)


class WeightStats:
    """Token sums behind the ``correction/`` weight metrics, accumulated on the tensors' device.

    ``add`` runs no host sync (it may be called once per minibatch); ``as_dict`` reads everything
    back in one transfer. ``bound_kind`` ("truncated" or "masked") names the high/low fractions.
    """

    # float64 sums, in this order; then the maxima: max w, max −w (kept tokens), max |a − μ|
    _SUMS = ("tokens", "kept", "w", "high", "low", "nonfinite", "finite", "absdiff", "k3")

    def __init__(self, bound_kind: str = "truncated"):
        self.bound_kind = bound_kind
        self._sums: torch.Tensor | None = None
        self._maxima: torch.Tensor | None = None

    def add(self, anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, w: Weights) -> None:
        """Accumulate one set of tokens ([B, R] each; ``anchor`` before any replacement)."""
        anchor, mu = anchor.float(), mu.float()
        r = log_ratio(anchor, mu, mask)
        kept = r.valid & (w.keep > 0)
        finite = r.finite & ~w.nonfinite  # tokens rejected as non-finite stay out of |a − μ| and KL
        absdiff = torch.where(finite, r.d.abs(), 0.0)
        # KL(μ ‖ π_anchor) with samples from μ, k3: (ρ − 1) − log ρ, ρ = exp(a − μ), in fp64
        k3 = torch.where(finite, kl_estimate(mu.double(), anchor.double(), "k3"), 0.0)
        f64 = torch.float64
        sums = torch.stack(
            [
                r.valid.sum(dtype=f64),
                kept.sum(dtype=f64),
                torch.where(kept, w.weights, 0.0).sum(dtype=f64),
                w.high.sum(dtype=f64),
                w.low.sum(dtype=f64),
                w.nonfinite.sum(dtype=f64),
                finite.sum(dtype=f64),
                absdiff.sum(dtype=f64),
                k3.sum(dtype=f64),
            ]
        )
        none = torch.tensor(-torch.inf, device=anchor.device)
        maxima = torch.stack(
            [
                torch.where(kept, w.weights, none).max(),
                torch.where(kept, -w.weights, none).max(),
                absdiff.max(),
            ]
        ).to(f64)
        if self._sums is None:
            self._sums, self._maxima = sums, maxima
        else:
            self._sums = self._sums + sums
            self._maxima = torch.maximum(self._maxima, maxima)

    def as_dict(self) -> dict[str, float]:
        """``{"correction/...": float}`` of everything added so far (zeros before any ``add``)."""
        if self._sums is None:
            s, (w_max, neg_w_min, ad_max) = dict.fromkeys(self._SUMS, 0.0), (0.0, 0.0, 0.0)
        else:
            values = torch.cat([self._sums, self._maxima]).tolist()  # the one host sync
            s = dict(zip(self._SUMS, values))
            w_max, neg_w_min, ad_max = values[len(self._SUMS) :]
        n, kept, fin = max(s["tokens"], 1.0), s["kept"], s["finite"]
        return {
            "correction/tokens": s["tokens"],
            "correction/retained_fraction": kept / n if s["tokens"] else 1.0,
            "correction/is_weight_mean": s["w"] / kept if kept else 0.0,
            "correction/is_weight_max": w_max if kept else 0.0,
            "correction/is_weight_min": -neg_w_min if kept else 0.0,
            f"correction/frac_{self.bound_kind}_high": s["high"] / n,
            f"correction/frac_{self.bound_kind}_low": s["low"] / n,
            "correction/frac_nonfinite": s["nonfinite"] / n,
            "correction/abs_diff_mean": s["absdiff"] / fin if fin else 0.0,
            "correction/abs_diff_max": ad_max,
            "correction/kl_k3": s["k3"] / fin if fin else 0.0,
        }


def staleness_metrics(
    versions: torch.Tensor, mask: torch.Tensor, step: int, prefix: str = "correction/"
) -> dict[str, float]:
    """min / mean / max of step − v_t over response tokens (``{prefix}staleness_min`` ...;
    zeros without any token)."""
    valid = mask > 0
    if not valid.any():
        return {f"{prefix}staleness_{k}": 0.0 for k in ("min", "mean", "max")}
    s = (step - versions[valid]).double()
    return {
        f"{prefix}staleness_min": float(s.min()),
        f"{prefix}staleness_mean": float(s.mean()),
        f"{prefix}staleness_max": float(s.max()),
    }
