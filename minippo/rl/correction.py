"""Behaviour-policy corrections for asynchronous PPO (the spec: docs/corrections.md).

In async PPO a token was sampled by the engine with weight version v_t, while the trainer now holds
newer weights. Each correction decides the anchor a_t that PPO's ratio r_t = exp(log π_θ − a_t) is
taken against, a per-token weight w_t and a keep-mask k_t:

    method            anchor a_t                          weight w_t / keep k_t
    rollout_logprobs  μ_t (engine logprob)                1 / 1
    tis               log π_{θ_k} (weights at step start)  truncated or masked ρ = exp(a − μ)
    keep_old_actor    log π_{θ_{v_t}} (exact snapshot)    min(ρ, cap) / 1
    ewma              log π_θ̄ (weight moving average)    ρ on 1/c ≤ ρ ≤ c, else 0 / same
    loglinear_prox    μ + α_t·(sg(log π_θ) − μ)           min(exp(a − μ), cap) / 1
    none              log π_{θ_k}                          1 / 1

Every correction has the same small interface, called by the recipe:

    validate_async_off_policy_correction(cfg)      # very first line of the recipe
    corr = build_correction(cfg, temperature=..., updates_per_step=...)
    corr.on_weights_published(0, actor)            # initial weights sample version 0
    for step k:
        out = corr.prepare(batch, actor, step=k)   # once, before the first update of the step
        for epoch, minibatch rows:
            logp = token_logprobs(actor, ...)      # with grad
            mb = out.minibatch(rows, logp)         # anchor, weights, keep-mask of those rows
            loss = policy_loss(logp, mb.anchor_logprobs, adv, mask, weights=mb.weights,
                               keep_mask=mb.keep_mask)
            optimizer.step(); corr.after_optimizer_step(actor)
        corr.retain(versions still referenced by queued / in-flight tokens)
        publish weights v = k + 1; corr.on_weights_published(k + 1, actor)
        log out.metrics

Version convention: version 0 is the initial weights and version k + 1 is published after the
updates of step k, so at the start of step k the actor holds version k and a token's staleness is
k − v_t.

Per-rank state: every weight copy (EWMA θ̄, old-actor snapshots) holds only this rank's local
shards (``p.to_local()`` for FSDP2 DTensor parameters). Swapping other weights into the actor copies
them into the parameters' storage in place (save the local shards into a reusable buffer, copy the
other weights in, forward, copy back), so no second model is ever built.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from minippo.rl.kl import kl_estimate
from minippo.rl.losses import LOG_RATIO_CLAMP  # log-ratios are clamped to ±20 before exp
from minippo.rl.types import RolloutBatch

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
STORAGE_DEVICES = ("cpu", "accelerator")
STORAGE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# Constructor arguments every correction takes; the recipe passes them (see build_correction).
COMMON_OPTIONS = ("temperature", "max_staleness", "updates_per_step", "score_fn", "process_group")
COMPONENT_PREFIX = "minippo.rl.correction."
# advantage estimators that train a critic (every other estimator counts as critic-free)
CRITIC_ESTIMATORS = ("gae",)

ScoreFn = Callable[[nn.Module, RolloutBatch], torch.Tensor]


# --------------------------------------------------------------------------------------------
# Scoring and weight plumbing
# --------------------------------------------------------------------------------------------


def response_logprobs(model: nn.Module, batch: RolloutBatch, *, temperature: float) -> torch.Tensor:
    """log π(response token) of every response position, no grad: Float32[B, R].

    The default ``score_fn``: ``minippo.models.token_logprobs`` with the batch's attention mask and
    positions, ``start = P`` and the sampling temperature (imported lazily so that importing this
    module stays cheap).
    """
    from minippo.models import token_logprobs

    return token_logprobs(
        model,
        batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        temperature=temperature,
        start=batch.prompt_len,
    )


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """The rank-local data of every parameter, in ``model.parameters()`` order (tied ones once).

    FSDP2 parameters are DTensors: their local shard (``to_local()``) shares storage with the
    parameter, so an in-place copy into it changes the model. Plain tensors are returned as is.
    """
    from torch.distributed.tensor import DTensor

    from minippo.parallel.fsdp import reshard_all

    reshard_all(model)  # the local shards are only meaningful in the sharded state
    out = []
    with torch.no_grad():
        for p in model.parameters():
            t = p.detach()
            out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out


def _is_sharded(model: nn.Module) -> list[bool]:
    from torch.distributed.tensor import DTensor

    return [isinstance(p, DTensor) for p in model.parameters()]


def _alloc_like(
    tensors: list[torch.Tensor], *, dtype: torch.dtype | None, device: torch.device | None
) -> list[torch.Tensor]:
    """Empty contiguous tensors shaped like ``tensors``; pinned when on CPU and CUDA is present."""
    out = []
    for t in tensors:
        dev = t.device if device is None else device
        pin = dev.type == "cpu" and torch.cuda.is_available()
        out.append(torch.empty(t.shape, dtype=dtype or t.dtype, device=dev, pin_memory=pin))
    return out


def _check_like(name: str, stored: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
    if len(stored) != len(shards) or any(a.shape != b.shape for a, b in zip(stored, shards)):
        raise ValueError(
            f"{name} holds {len(stored)} tensors that do not match the actor's {len(shards)} local "
            "parameter shards (different model or sharding than the one it was taken from)"
        )


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _ParamSwap:
    """Loads other weights into a model's local shards in place and puts the originals back.

    The originals are saved once into a reusable buffer (allocated on first use, same dtype as the
    parameters, on ``device`` or the parameters' device); every copy is one ``_foreach_copy_``.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._saved: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the reusable buffer (0 before the first swap)."""
        return 0 if self._saved is None else _nbytes(self._saved)

    @contextmanager
    def borrow(self, model: nn.Module) -> Iterator[Callable[[list[torch.Tensor]], None]]:
        """Yield ``load(weights)``, which copies weights into the model's local shards in place;
        the original weights are back on exit (also on error)."""
        from minippo.parallel.fsdp import reshard_all

        shards = local_shards(model)
        layout = [(s.shape, s.dtype) for s in shards]
        if self._saved is None or [(s.shape, s.dtype) for s in self._saved] != layout:
            self._saved = _alloc_like(shards, dtype=None, device=self.device)

        def load(weights: list[torch.Tensor]) -> None:
            _check_like("the weights to load", weights, shards)
            # a forward may have left unsharded copies that would shadow the write
            reshard_all(model)
            torch._foreach_copy_(shards, weights)

        with torch.no_grad():
            torch._foreach_copy_(self._saved, shards)
            try:
                yield load
            finally:
                load(self._saved)


def _process_group(group: Any) -> Any:
    """The group to agree on across ranks, or None on a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) == 1:
        return None
    return group if group is not None else dist.group.WORLD


def _all_reduce(values: list[float], op: str, group: Any, device: torch.device) -> list[float]:
    """Sum or max of a few floats over the ranks of ``group`` (identity without a group)."""
    if group is None:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t.tolist()


# --------------------------------------------------------------------------------------------
# Pure weight functions (shapes: [B, R]; mask m is 1.0 on response tokens)
# --------------------------------------------------------------------------------------------


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


def _finite_log_ratio(
    anchor: torch.Tensor, mu: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """d = a − μ with non-finite entries set to 0, and the bool mask of finite valid tokens."""
    d = anchor - mu
    finite = torch.isfinite(d) & valid
    return torch.where(finite, d, torch.zeros_like(d)), finite


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
    valid = mask > 0
    d, finite = _finite_log_ratio(anchor, mu, valid)
    if level == "token":
        log_rho, ok = d, finite
    else:
        row_ok = ~(valid & ~finite).any(dim=1, keepdim=True)
        s = (d * mask).sum(dim=1, keepdim=True)  # Σ m d
        if level == "geometric":
            s = s / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # Σ m d / Σ m
        elif level != "sequence":
            raise ValueError(f"tis level {level!r} is not one of {TIS_LEVELS}")
        log_rho = s.expand_as(d)
        ok = valid & row_ok
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
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
    zero = torch.zeros_like(rho)
    return Weights(torch.where(keep, w, zero), keep.float(), high, lo, valid & ~ok)


def discrepancy_weights(
    anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, *, cap: float | None = 2.0
) -> Weights:
    """keep_old_actor's train-vs-inference weight: w = clamp(exp(a − μ), 0, cap), k = 1.

    With ``cap=None`` the weight is 1. Non-finite ratios are rejected (w = k = 0).
    """
    valid = mask > 0
    d, finite = _finite_log_ratio(anchor, mu, valid)
    rho = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if cap is None:
        w, high = torch.ones_like(rho), torch.zeros_like(finite)
    else:
        w, high = rho.clamp(max=cap), finite & (rho > cap)
    zero = torch.zeros_like(rho)
    return Weights(
        torch.where(finite, w, zero), finite.float(), high, torch.zeros_like(high), valid & ~finite
    )


def symmetric_mask_weights(
    anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0
) -> Weights:
    """EWMA's train-inference mask: keep ρ = exp(a − μ) in [1/c, c]; w = ρ on kept tokens, else 0."""
    valid = mask > 0
    d, finite = _finite_log_ratio(anchor, mu, valid)
    rho = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    high = finite & (rho > cap)
    lo = finite & (rho < 1.0 / cap)
    keep = finite & ~high & ~lo
    return Weights(
        torch.where(keep, rho, torch.zeros_like(rho)), keep.float(), high, lo, valid & ~finite
    )


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
    valid = mask > 0
    lp = policy_logprobs.detach().float()
    anchor = mu + alpha * (lp - mu)
    d, finite = _finite_log_ratio(anchor, mu, valid)
    rho = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    high = finite & (rho > cap)
    zero = torch.zeros_like(rho)
    anchor = torch.where(finite, anchor, torch.where(valid, mu, zero))
    w = torch.where(finite, rho.clamp(max=cap), zero)
    return anchor, Weights(w, finite.float(), high, torch.zeros_like(high), valid & ~finite)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


@dataclass
class _WeightStats:
    """Token-weighted sums behind the ``correction/`` weight metrics (accumulates over calls)."""

    tokens: float = 0.0
    kept: float = 0.0
    w_sum: float = 0.0
    w_max: float = -math.inf
    w_min: float = math.inf
    high: float = 0.0
    low: float = 0.0
    nonfinite: float = 0.0
    absdiff_sum: float = 0.0
    absdiff_max: float = 0.0
    k3_sum: float = 0.0
    finite: float = 0.0
    bound_kind: str = "truncated"  # or "masked"

    def add(self, anchor: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, w: Weights) -> None:
        valid = mask > 0
        kept = valid & (w.keep > 0)
        anchor, mu = anchor.float(), mu.float()
        d, finite = _finite_log_ratio(anchor, mu, valid)
        finite = finite & ~w.nonfinite  # tokens rejected as non-finite stay out of |a − μ| and KL
        self.tokens += float(valid.sum())
        self.kept += float(kept.sum())
        if kept.any():
            wk = w.weights[kept]
            self.w_sum += float(wk.sum())
            self.w_max = max(self.w_max, float(wk.max()))
            self.w_min = min(self.w_min, float(wk.min()))
        self.high += float(w.high.sum())
        self.low += float(w.low.sum())
        self.nonfinite += float(w.nonfinite.sum())
        self.finite += float(finite.sum())
        if finite.any():
            ad = d.abs()[finite]
            self.absdiff_sum += float(ad.sum())
            self.absdiff_max = max(self.absdiff_max, float(ad.max()))
            # KL(μ ‖ π_anchor) with samples from μ, k3: (ρ − 1) − log ρ, ρ = exp(a − μ), in fp64
            k3 = kl_estimate(mu[finite].double(), anchor[finite].double(), "k3")
            self.k3_sum += float(k3.sum())

    def as_dict(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        other = "masked" if self.bound_kind == "truncated" else "truncated"
        return {
            "correction/tokens": self.tokens,
            "correction/retained_fraction": self.kept / n if self.tokens else 1.0,
            "correction/is_weight_mean": self.w_sum / self.kept if self.kept else 0.0,
            "correction/is_weight_max": self.w_max if self.kept else 0.0,
            "correction/is_weight_min": self.w_min if self.kept else 0.0,
            f"correction/frac_{self.bound_kind}_high": self.high / n,
            f"correction/frac_{self.bound_kind}_low": self.low / n,
            f"correction/frac_{other}_high": 0.0,
            f"correction/frac_{other}_low": 0.0,
            "correction/frac_nonfinite": self.nonfinite / n,
            "correction/abs_diff_mean": self.absdiff_sum / self.finite if self.finite else 0.0,
            "correction/abs_diff_max": self.absdiff_max,
            "correction/kl_k3": self.k3_sum / self.finite if self.finite else 0.0,
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


# --------------------------------------------------------------------------------------------
# Output containers
# --------------------------------------------------------------------------------------------


@dataclass
class MinibatchCorrection:
    """What the policy loss of one minibatch takes, all [b, R] and without grad.

    anchor_logprobs: float32 a_t;  weights: float32 w_t;  keep_mask: float32 k_t.
    """

    anchor_logprobs: torch.Tensor
    weights: torch.Tensor
    keep_mask: torch.Tensor


@dataclass
class CorrectionOutput:
    """Result of ``Correction.prepare`` for one step; shared by every epoch and minibatch.

    Fields ([B, R] response-aligned, float32, no grad; 0 on padding):
        anchor_logprobs: a_t. None for loglinear_prox, whose anchor follows the current policy
                         (use ``minibatch(rows, policy_logprobs)``).
        weights:         w_t (0 on rejected tokens). None for loglinear_prox.
        keep_mask:       k_t, 1.0 on kept response tokens.
        metrics:         ``{"correction/...": float}``. For loglinear_prox the weight metrics are
                         completed by the ``minibatch`` calls: log this dict after the updates.
        alpha:           loglinear_prox's α_t (fixed for the step), else None.
        rollout_logprobs, response_mask: μ_t and m_t of the batch.
        cap:             loglinear_prox's weight cap.
    """

    anchor_logprobs: torch.Tensor | None
    weights: torch.Tensor | None
    keep_mask: torch.Tensor
    metrics: dict[str, float]
    rollout_logprobs: torch.Tensor
    response_mask: torch.Tensor
    alpha: torch.Tensor | None = None
    cap: float = 2.0
    _stats: _WeightStats | None = field(default=None, repr=False)

    def minibatch(
        self,
        rows: torch.Tensor | slice | None = None,
        policy_logprobs: torch.Tensor | None = None,
    ) -> MinibatchCorrection:
        """Anchor, weights and keep-mask of the minibatch ``rows`` (default: all rows).

        Args:
            rows: Long[b] row indices or a slice into the step's batch.
            policy_logprobs: Float[b, R] log π_θ of those rows (detached here); required by
                loglinear_prox, ignored by every other method.
        """
        rows = slice(None) if rows is None else rows
        if self.alpha is None:
            return MinibatchCorrection(
                self.anchor_logprobs[rows], self.weights[rows], self.keep_mask[rows]
            )
        if policy_logprobs is None:
            raise ValueError(
                "loglinear_prox needs the minibatch's current logprobs: call "
                "out.minibatch(rows, policy_logprobs) with log π_θ of those rows"
            )
        mu, mask, alpha = self.rollout_logprobs[rows], self.response_mask[rows], self.alpha[rows]
        if policy_logprobs.shape != mu.shape:
            raise ValueError(
                f"policy_logprobs has shape {tuple(policy_logprobs.shape)}, expected "
                f"{tuple(mu.shape)} (the minibatch's [b, R])"
            )
        anchor, w = loglinear_prox_weights(policy_logprobs, mu, alpha, mask, cap=self.cap)
        if self._stats is not None:
            self._stats.add(anchor, mu, mask, w)
            self.metrics.update(self._stats.as_dict())
        return MinibatchCorrection(anchor, w.weights, w.keep)


# --------------------------------------------------------------------------------------------
# Option checks (shared by the constructors and the fail-fast config check)
# --------------------------------------------------------------------------------------------


def _num(method: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"correction {method}: {key} must be a number, got {value!r}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(method: str, options: dict[str, Any]) -> None:
    """Raise ValueError naming the values when ``options`` are unknown or contradictory for ``method``.

    ``options`` are the constructor keyword arguments (the YAML keys besides ``_component_``).
    """
    if method not in METHODS:
        raise ValueError(f"unknown correction method {method!r}; choose one of {sorted(METHODS)}")
    cls = METHODS[method]
    allowed = set(cls.options) | set(COMMON_OPTIONS)
    unknown = sorted(set(options) - allowed)
    if unknown:
        tis_keys = [k for k in unknown if k in TIS.options]
        hint = ""
        if method == "rollout_logprobs" and tis_keys:
            hint = (
                f" rollout_logprobs uses the engine logprobs as the anchor and is incompatible "
                f"with tis options ({', '.join(f'{k}={options[k]!r}' for k in tis_keys)}); for "
                f"truncated importance sampling set correction._component_={COMPONENT_PREFIX}TIS."
            )
        raise ValueError(
            f"correction {method} does not take {', '.join(f'{k}={options[k]!r}' for k in unknown)};"
            f" its options are {list(cls.options) or 'none'}.{hint}"
        )
    o = options
    if o.get("temperature") is not None and _num(method, "temperature", o["temperature"]) < 0:
        raise ValueError(f"correction {method}: temperature must be >= 0, got {o['temperature']}")
    if "max_staleness" in o and (not _is_int(o["max_staleness"]) or o["max_staleness"] < 0):
        raise ValueError(
            f"correction {method}: max_staleness must be an int >= 0, got {o['max_staleness']!r}"
        )
    if "updates_per_step" in o and (
        not _is_int(o["updates_per_step"]) or o["updates_per_step"] < 1
    ):
        raise ValueError(
            f"correction {method}: updates_per_step must be an int >= 1 (ppo.epochs × "
            f"ppo.minibatches), got {o['updates_per_step']!r}"
        )
    if "cap" in o and o["cap"] is not None:
        cap = _num(method, "cap", o["cap"])
        if cap <= 0:
            raise ValueError(f"correction {method}: cap must be > 0, got cap={o['cap']}")
        if method == "ewma" and cap <= 1:
            raise ValueError(
                f"correction ewma: cap (c) must be > 1 so that the mask [1/c, c] keeps ρ = 1, "
                f"got cap={o['cap']}"
            )
    elif "cap" in o and method != "keep_old_actor":
        raise ValueError(f"correction {method}: cap must be a number > 0, got cap=None")
    if method == "tis":
        level, mode = o.get("level", "token"), o.get("mode", "truncate")
        if level not in TIS_LEVELS:
            raise ValueError(f"correction tis: level={level!r} is not one of {list(TIS_LEVELS)}")
        if mode not in TIS_MODES:
            raise ValueError(f"correction tis: mode={mode!r} is not one of {list(TIS_MODES)}")
        low = _num(method, "low", o.get("low", 0.0))
        cap = _num(method, "cap", o.get("cap", 2.0))
        if low < 0:
            raise ValueError(f"correction tis: low must be >= 0, got low={low}")
        if low >= cap:
            raise ValueError(f"correction tis: low ({low}) must be < cap ({cap})")
    if method == "ewma":
        beta = o.get("beta")
        if beta is not None and not 0 < _num(method, "beta", beta) < 1:
            raise ValueError(f"correction ewma: beta must be in (0, 1), got beta={beta}")
        rb = o.get("reset_below", 0.8)
        if not 0 < _num(method, "reset_below", rb) < 1:
            raise ValueError(
                f"correction ewma: reset_below must be in (0, 1), got reset_below={rb}"
            )
        if o.get("swap_storage", "accelerator") not in STORAGE_DEVICES:
            raise ValueError(
                f"correction ewma: swap_storage={o['swap_storage']!r} is not one of "
                f"{list(STORAGE_DEVICES)}"
            )
    if method == "keep_old_actor":
        if o.get("storage", "cpu") not in STORAGE_DEVICES:
            raise ValueError(
                f"correction keep_old_actor: storage={o['storage']!r} is not one of "
                f"{list(STORAGE_DEVICES)}"
            )
        sd = o.get("storage_dtype")
        if sd is not None and not isinstance(sd, torch.dtype) and sd not in STORAGE_DTYPES:
            raise ValueError(
                f"correction keep_old_actor: storage_dtype={sd!r} is not null (the training dtype)"
                f" or one of {sorted(STORAGE_DTYPES)}"
            )


# --------------------------------------------------------------------------------------------
# The corrections
# --------------------------------------------------------------------------------------------


class Correction:
    """Shared plumbing of every correction: scoring, checks, staleness metrics, default hooks.

    Constructor arguments common to all methods (the recipe passes them, see build_correction):
        temperature:      sampling temperature T; anchors are log_softmax(logits / T) like μ
                          (T = 0, greedy, scores at T = 1 like the engine).
        max_staleness:    rollout.max_staleness (EWMA derives β from it).
        updates_per_step: optimizer steps per training step = ppo.epochs × ppo.minibatches
                          (× optimizer steps per minibatch).
        score_fn:         (model, batch) -> Float[B, R] response logprobs; default
                          ``response_logprobs`` at ``temperature``.
        process_group:    ranks that share the actor's shards (default: the world when
                          torch.distributed is initialized). prepare() is then collective.
    """

    method: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        max_staleness: int = 0,
        updates_per_step: int = 1,
        score_fn: ScoreFn | None = None,
        process_group: Any = None,
    ):
        check_options(
            self.method,
            {
                "temperature": temperature,
                "max_staleness": max_staleness,
                "updates_per_step": updates_per_step,
            },
        )
        self.temperature = temperature
        self.max_staleness = max_staleness
        self.updates_per_step = updates_per_step
        t = temperature if temperature > 0 else 1.0
        self.score_fn: ScoreFn = score_fn or partial(response_logprobs, temperature=t)
        self.process_group = process_group
        self._forwards = 0

    # ---- hooks (no-ops unless a method keeps state) -------------------------------------
    def prepare(self, batch: RolloutBatch, actor: nn.Module, *, step: int) -> CorrectionOutput:
        """Anchors, weights, keep-mask and metrics of ``batch`` at the start of step ``step``.

        Call once per step, before the first optimizer update; every epoch and minibatch of the
        step then uses the returned output. Collective under torch.distributed.
        """
        _check_batch(batch, step)
        self._forwards = 0
        out = self._prepare(batch, actor, step)
        out.metrics.update(staleness_metrics(batch.versions, batch.response_mask, step))
        out.metrics["correction/forward_passes"] = float(self._forwards)
        return out

    def after_optimizer_step(self, actor: nn.Module) -> None:
        """Called after every optimizer step of the actor."""

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        """Called when ``actor``'s current weights are published as ``version`` (0: initial)."""

    def retain(self, versions: Iterable[int]) -> None:
        """The weight versions still referenced by queued or in-flight tokens."""

    def release_versions_below(self, version: int) -> None:
        """No token older than ``version`` will be trained on any more."""

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (tensors are this rank's local shards)."""
        return {"method": self.method}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(
                f"checkpoint holds correction state of method {state.get('method')!r}, but this "
                f"run's correction is {self.method!r}; set correction._component_ to match or "
                "start without the correction state"
            )

    # ---- helpers ------------------------------------------------------------------------
    def _prepare(self, batch: RolloutBatch, actor: nn.Module, step: int) -> CorrectionOutput:
        raise NotImplementedError

    def _score(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """One no-grad forward: Float32[B, R] logprobs of the response tokens."""
        with torch.no_grad():
            lp = self.score_fn(model, batch)
        self._forwards += 1
        if lp.shape != batch.response_mask.shape:
            raise ValueError(
                f"score_fn returned shape {tuple(lp.shape)}, expected [B, R] = "
                f"{tuple(batch.response_mask.shape)}"
            )
        return lp.detach().float()

    def _output(
        self,
        batch: RolloutBatch,
        anchor: torch.Tensor,
        w: Weights,
        bound_kind: str = "truncated",
    ) -> CorrectionOutput:
        mask, mu = batch.response_mask, batch.rollout_logprobs.float()
        valid = mask > 0
        stats = _WeightStats(bound_kind=bound_kind)
        stats.add(anchor, mu, mask, w)  # before the replacement below: rejected tokens stay out
        # non-finite anchors are rejected (k = 0) and replaced by μ (by 0 where μ is not finite
        # either); pads get 0: no non-finite value leaves the module
        fallback = torch.where(valid & torch.isfinite(mu), mu, torch.zeros_like(mu))
        anchor = torch.where(torch.isfinite(anchor) & valid, anchor, fallback)
        return CorrectionOutput(anchor, w.weights, w.keep, stats.as_dict(), mu, mask)


def _check_batch(batch: RolloutBatch, step: int) -> None:
    valid = batch.response_mask > 0
    if batch.rollout_logprobs.shape != batch.response_mask.shape or (
        batch.versions.shape != batch.response_mask.shape
    ):
        raise ValueError(
            f"rollout_logprobs {tuple(batch.rollout_logprobs.shape)} and versions "
            f"{tuple(batch.versions.shape)} must be response-aligned like response_mask "
            f"{tuple(batch.response_mask.shape)}"
        )
    if valid.any():
        v = batch.versions[valid]
        lo, hi = int(v.min()), int(v.max())
        if lo < 0 or hi > step:
            raise ValueError(
                f"token versions must lie in [0, step={step}] (version k is what the actor holds "
                f"at the start of step k), got versions in [{lo}, {hi}]"
            )


class RolloutLogprobs(Correction):
    """a_t = μ_t, w_t = 1: no extra forward; the clip absorbs discrepancy and staleness together."""

    method = "rollout_logprobs"
    options = ()

    def _prepare(self, batch, actor, step):
        mu, mask = batch.rollout_logprobs.float(), batch.response_mask
        valid = mask > 0
        ok = valid & torch.isfinite(mu)  # a non-finite μ is rejected (and counted), like elsewhere
        none = torch.zeros_like(valid)
        w = Weights(ok.float(), ok.float(), none, none, valid & ~ok)
        return self._output(batch, torch.where(ok, mu, 0.0), w)


class NoCorrection(Correction):
    """a_t = log π_{θ_k} (current weights at the step start), w_t = 1: synchronous PPO."""

    method = "none"
    options = ()

    def _prepare(self, batch, actor, step):
        anchor = self._score(actor, batch)
        w = discrepancy_weights(
            anchor, batch.rollout_logprobs.float(), batch.response_mask, cap=None
        )
        return self._output(batch, anchor, w)


class TIS(Correction):
    """Truncated importance sampling against the weights at the start of the step.

    Args: level ("token" | "sequence" | "geometric"), mode ("truncate" | "mask"), low (≥ 0),
    cap (> low), plus the common arguments of ``Correction``.
    """

    method = "tis"
    options = ("level", "mode", "low", "cap")

    def __init__(
        self,
        *,
        level: str = "token",
        mode: str = "truncate",
        low: float = 0.0,
        cap: float = 2.0,
        **common: Any,
    ):
        check_options(self.method, {"level": level, "mode": mode, "low": low, "cap": cap})
        super().__init__(**common)
        self.level, self.mode, self.low, self.cap = level, mode, float(low), float(cap)

    def _prepare(self, batch, actor, step):
        anchor = self._score(actor, batch)
        w = truncated_is_weights(
            anchor,
            batch.rollout_logprobs.float(),
            batch.response_mask,
            level=self.level,
            mode=self.mode,
            low=self.low,
            cap=self.cap,
        )
        return self._output(batch, anchor, w, "masked" if self.mode == "mask" else "truncated")


class LogLinearProx(Correction):
    """A-3PO baseline: a_t = μ_t + α_t·(sg(log π_θ) − μ_t), α_t fixed per step; no extra forward.

    The anchor follows the current policy by definition, so ``prepare`` fixes α and μ for the
    step and ``CorrectionOutput.minibatch(rows, policy_logprobs)`` forms a and w per minibatch.
    """

    method = "loglinear_prox"
    options = ("cap",)

    def __init__(self, *, cap: float = 2.0, **common: Any):
        check_options(self.method, {"cap": cap})
        super().__init__(**common)
        self.cap = float(cap)

    def _prepare(self, batch, actor, step):
        mask = batch.response_mask
        alpha = loglinear_alpha(batch.versions, mask, step)
        valid = mask > 0
        stats = _WeightStats()
        metrics = stats.as_dict()
        a = alpha[valid]
        metrics["correction/alpha_mean"] = float(a.mean()) if a.numel() else 0.0
        metrics["correction/alpha_max"] = float(a.max()) if a.numel() else 0.0
        return CorrectionOutput(
            None,
            None,
            mask.float().clone(),
            metrics,
            batch.rollout_logprobs.float(),
            mask,
            alpha=alpha,
            cap=self.cap,
            _stats=stats,
        )


@dataclass
class _Snapshot:
    version: int
    tensors: list[torch.Tensor]


class KeepOldActor(Correction):
    """Exact old logits: a per-rank snapshot of the local shards of every live weight version.

    Args:
        cap: w_t = clamp(exp(a_t − μ_t), 0, cap), the train-vs-inference discrepancy weight;
            None for w_t = 1.
        storage: "cpu" (pinned when CUDA is available) or "accelerator" (the parameters' device).
        storage_dtype: None (the training dtype: exact anchors) or "bf16" / "fp32" / "fp16".
        plus the common arguments of ``Correction``.

    Lifetime: ``on_weights_published(v, actor)`` copies the weights that will sample version v.
    The latest published version is always kept (the engines sample with it); every other version
    is kept until ``retain(versions)`` no longer lists it or ``release_versions_below`` passes it.
    ``prepare(step=k)`` itself releases the versions below k + 1 − max_staleness, which no later
    batch may contain (the rollout queue refuses tokens older than step − max_staleness).
    ``prepare`` scores the whole batch once per distinct version present (on any rank) and takes
    each token's anchor from the forward of its own version; a token without a snapshot of its
    version is an error.
    """

    method = "keep_old_actor"
    options = ("cap", "storage", "storage_dtype")

    def __init__(
        self,
        *,
        cap: float | None = 2.0,
        storage: str = "cpu",
        storage_dtype: str | torch.dtype | None = None,
        **common: Any,
    ):
        check_options(self.method, {"cap": cap, "storage": storage, "storage_dtype": storage_dtype})
        super().__init__(**common)
        self.cap = None if cap is None else float(cap)
        self.storage = storage
        self.storage_dtype = (
            STORAGE_DTYPES[storage_dtype] if isinstance(storage_dtype, str) else storage_dtype
        )
        self._snapshots: dict[int, _Snapshot] = {}
        self._latest: int | None = None
        self._swap: _ParamSwap | None = None
        # the buffers of the last evicted version, reused by the next publish: in the training
        # loop a version is evicted (prepare) just before the next one is published, so the
        # reuse saves an allocation (and its page faults) per step without raising peak memory
        self._spare: list[torch.Tensor] | None = None

    # ---- snapshot lifetime ----------------------------------------------------------------
    @property
    def live_versions(self) -> list[int]:
        return sorted(self._snapshots)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by the snapshots of this rank (Σ numel × element size over live versions)."""
        return sum(_nbytes(s.tensors) for s in self._snapshots.values())

    def _storage_device(self) -> torch.device | None:
        """CPU for "cpu" storage; None (each parameter's own device) for "accelerator"."""
        return torch.device("cpu") if self.storage == "cpu" else None

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        if self._latest is not None and version < self._latest:
            raise ValueError(
                f"keep_old_actor: published version {version} is older than the last published "
                f"version {self._latest}; versions must not decrease"
            )
        shards = local_shards(actor)
        if version in self._snapshots:  # re-published (e.g. after a resume): overwrite in place
            snap = self._snapshots[version].tensors
            _check_like(f"snapshot of version {version}", snap, shards)
        elif self._spare is not None and [t.shape for t in self._spare] == [
            t.shape for t in shards
        ]:
            snap, self._spare = self._spare, None
        else:
            snap = _alloc_like(shards, dtype=self.storage_dtype, device=self._storage_device())
        with torch.no_grad():
            torch._foreach_copy_(snap, shards)
        self._snapshots[version] = _Snapshot(version, snap)
        self._latest = version

    def retain(self, versions: Iterable[int]) -> None:
        """Keep exactly ``versions`` (plus the latest published one); evict every other snapshot.

        Raises if a listed version has no snapshot: a queued token would then miss its anchor.
        """
        keep = {int(v) for v in versions}
        missing = sorted(keep - set(self._snapshots))
        if missing:
            raise ValueError(
                f"keep_old_actor: versions {missing} are still referenced but have no snapshot "
                f"(live: {self.live_versions}); they were evicted or never published"
            )
        for v in list(self._snapshots):
            if v not in keep and v != self._latest:
                self._spare = self._snapshots.pop(v).tensors

    def release_versions_below(self, version: int) -> None:
        """Evict every snapshot older than ``version`` (the latest published one is kept)."""
        self.retain(v for v in self._snapshots if v >= version)

    # ---- anchors --------------------------------------------------------------------------
    def _prepare(self, batch, actor, step):
        mask, versions = batch.response_mask, batch.versions
        valid = mask > 0
        present = [int(v) for v in torch.unique(versions[valid]).tolist()]
        group = _process_group(self.process_group)
        device = mask.device  # the batch lives on the actor's device (it is scored there)
        to_score = _union_versions(present, group, device)
        if self._swap is None:
            self._swap = _ParamSwap(self._storage_device())
        anchor = torch.zeros_like(batch.rollout_logprobs, dtype=torch.float32)
        source = torch.full_like(versions, -1)  # the snapshot version each anchor came from
        with self._swap.borrow(actor) as load:
            for v in to_score:
                snap = self._snapshots.get(v)
                if snap is None:
                    continue
                load(snap.tensors)
                lp = self._score(actor, batch)
                sel = valid & (versions == v)
                anchor = torch.where(sel, lp, anchor)
                source = torch.where(sel, torch.full_like(source, snap.version), source)
        local_mismatch = int((valid & (source != versions)).sum())
        (mismatches,) = _all_reduce([float(local_mismatch)], "sum", group, device)
        if mismatches:
            missing = sorted(set(present) - set(self._snapshots))
            raise RuntimeError(
                f"keep_old_actor: {int(mismatches)} tokens (this rank: {local_mismatch}) have no "
                f"anchor from a snapshot of their own version (missing on this rank: {missing}; "
                f"live snapshots: {self.live_versions}). A version still referenced by queued "
                "tokens was evicted, or on_weights_published was not called for it."
            )
        # the queue's bound: batch k + 1 only holds tokens with v >= k + 1 - max_staleness
        self.release_versions_below(step + 1 - self.max_staleness)
        w = discrepancy_weights(anchor, batch.rollout_logprobs.float(), mask, cap=self.cap)
        out = self._output(batch, anchor, w)
        out.metrics.update(
            {
                "correction/version_mismatches": float(mismatches),
                "correction/versions_in_batch": float(len(present)),
                "correction/snapshot_versions": float(len(self._snapshots)),
                "correction/snapshot_oldest_version": float(min(self._snapshots, default=-1)),
                "correction/snapshot_bytes": float(self.snapshot_bytes),
                "correction/snapshot_spare_bytes": float(_nbytes(self._spare or [])),
                "correction/swap_buffer_bytes": float(self._swap.nbytes),
            }
        )
        return out

    # ---- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Snapshots are saved (per rank, local shards): the queued tokens they serve survive a
        resume only with their exact old weights, which cannot be rebuilt afterwards."""
        return {
            "method": self.method,
            "latest": self._latest,
            "snapshots": {v: list(s.tensors) for v, s in self._snapshots.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._snapshots = {}
        self._spare = None
        # "cpu" storage: fresh (pinned) CPU buffers; "accelerator": where the loader put them
        device = self._storage_device()
        for v, tensors in state["snapshots"].items():
            buf = _alloc_like(list(tensors), dtype=self.storage_dtype, device=device)
            with torch.no_grad():
                torch._foreach_copy_(buf, list(tensors))
            self._snapshots[int(v)] = _Snapshot(int(v), buf)
        self._latest = state["latest"]


def _union_versions(present: list[int], group: Any, device: torch.device) -> list[int]:
    """The versions present on any rank (every rank must run the same forwards under FSDP)."""
    if group is None:
        return sorted(present)
    lo, hi = (min(present), max(present)) if present else (math.inf, -math.inf)
    neg_lo, hi = _all_reduce([-lo, hi], "max", group, device)
    lo = -neg_lo
    if hi < lo:
        return []
    lo, hi = int(lo), int(hi)
    flags = [0.0] * (hi - lo + 1)
    for v in present:
        flags[v - lo] = 1.0
    flags = _all_reduce(flags, "max", group, device)
    return [lo + i for i, f in enumerate(flags) if f > 0]


class EWMA(Correction):
    """PPO-EWMA with reset: anchors from θ̄, a bias-corrected moving average of the weights.

    Args:
        beta: EWMA decay; default β = s / (1 + s), s = max_staleness × updates_per_step / 2 (the
            average's mean age β/(1−β) is then half the largest data age in optimizer steps).
            With s = 0 (synchronous) β = 0: θ̄ is the current weights.
        cap: c of the symmetric train-inference mask [1/c, c] (> 1).
        reset_below: reset θ̄ to the current weights when the retained fraction falls below this.
        swap_storage: where the buffer that saves the actor's weights while θ̄ is swapped in
            lives: "accelerator" (the parameters' device: two device-local copies per swap) or
            "cpu" (pinned when CUDA is available: saves one training-dtype copy of the local
            shards on the accelerator, the swap then crosses the host link twice).
        plus the common arguments of ``Correction``.

    θ̄ is fp32 local shards on the parameters' device, updated after every optimizer step by
        n ← β·n + 1 (n starts at 1),   θ̄ ← θ̄·(β·n_prev/n) + θ/n = lerp(θ̄, θ, 1/n)
    (β·n_prev/n = 1 − 1/n, so the update is one fused ``_foreach_lerp_``).
    """

    method = "ewma"
    options = ("beta", "cap", "reset_below", "swap_storage")

    def __init__(
        self,
        *,
        beta: float | None = None,
        cap: float = 2.0,
        reset_below: float = 0.8,
        swap_storage: str = "accelerator",
        **common: Any,
    ):
        check_options(
            self.method,
            {"beta": beta, "cap": cap, "reset_below": reset_below, "swap_storage": swap_storage},
        )
        super().__init__(**common)
        s = self.max_staleness * self.updates_per_step / 2
        self.beta = float(beta) if beta is not None else s / (1 + s)
        self.cap = float(cap)
        self.reset_below = float(reset_below)
        self.n = 1.0
        self.resets = 0
        self.theta_bar: list[torch.Tensor] | None = None
        self._swap = _ParamSwap(torch.device("cpu") if swap_storage == "cpu" else None)

    def _reset(self, actor: nn.Module) -> None:
        """θ̄ ← θ (fp32), n ← 1."""
        shards = local_shards(actor)
        if self.theta_bar is None:
            self.theta_bar = _alloc_like(shards, dtype=torch.float32, device=None)
        _check_like("EWMA θ̄", self.theta_bar, shards)
        with torch.no_grad():
            torch._foreach_copy_(self.theta_bar, shards)
        self.n = 1.0

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        if self.theta_bar is None:
            self._reset(actor)

    def after_optimizer_step(self, actor: nn.Module) -> None:
        if self.theta_bar is None:
            raise RuntimeError(
                "ewma: θ̄ is not initialised; call on_weights_published(0, actor) or prepare() "
                "before the first optimizer step"
            )
        shards = local_shards(actor)
        n_prev = self.n
        self.n = self.beta * n_prev + 1.0  # n ← β·n + 1
        with torch.no_grad():
            # θ̄ ← θ̄·(β·n_prev/n) + θ/n  ≡  θ̄ + (θ − θ̄)/n
            if all(s.dtype == torch.float32 for s in shards):
                torch._foreach_lerp_(self.theta_bar, shards, 1.0 / self.n)
            else:
                torch._foreach_mul_(self.theta_bar, self.beta * n_prev / self.n)
                torch._foreach_add_(self.theta_bar, shards, alpha=1.0 / self.n)

    def distance(self, actor: nn.Module) -> float:
        """‖θ̄ − θ‖₂ over the whole model (all ranks' shards)."""
        shards = local_shards(actor)
        device = shards[0].device if shards else torch.device("cpu")
        # Σ‖θ̄ − θ‖² of the sharded (summed over ranks) and the replicated (counted once)
        # parameters, accumulated in fp64 on the device: one host sync in all
        sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
        with torch.no_grad():
            for tb, t, sharded in zip(self.theta_bar, shards, _is_sharded(actor)):
                # one tensor-sized fp32 temporary at a time
                sq[0 if sharded else 1] += torch.linalg.vector_norm(tb - t.float()).double() ** 2
        group = _process_group(self.process_group)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(sq[0], group=group)
        return math.sqrt(float(sq[0] + sq[1]))

    def _prepare(self, batch, actor, step):
        if self.theta_bar is None:
            self._reset(actor)
        mu, mask = batch.rollout_logprobs.float(), batch.response_mask
        with self._swap.borrow(actor) as load:
            load(self.theta_bar)
            anchor = self._score(actor, batch)
        w = symmetric_mask_weights(anchor, mu, mask, cap=self.cap)
        # the reset decision is global: every rank's θ̄ shard must stay one model
        group = _process_group(self.process_group)
        kept, total = _all_reduce(
            [float((w.keep * mask).sum()), float(mask.sum())], "sum", group, anchor.device
        )
        retained = kept / total if total else 1.0
        reset = retained < self.reset_below
        if reset:
            # θ̄ ← θ, n ← 1; the current actor now equals θ̄, so it scores the reset anchors
            self._reset(actor)
            self.resets += 1
            anchor = self._score(actor, batch)
            w = symmetric_mask_weights(anchor, mu, mask, cap=self.cap)
        out = self._output(batch, anchor, w, "masked")
        out.metrics.update(
            {
                "correction/ewma_beta": self.beta,
                "correction/ewma_n": self.n,
                "correction/ewma_resets": float(self.resets),
                "correction/ewma_reset_this_step": float(reset),
                "correction/ewma_retained_before_reset": retained,
                "correction/ewma_distance": self.distance(actor),
                "correction/ewma_bytes": float(_nbytes(self.theta_bar)),
                "correction/swap_buffer_bytes": float(self._swap.nbytes),
            }
        )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "beta": self.beta,
            "n": self.n,
            "resets": self.resets,
            "theta_bar": None if self.theta_bar is None else list(self.theta_bar),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not math.isclose(state["beta"], self.beta, rel_tol=0, abs_tol=1e-12):
            raise ValueError(
                f"ewma: the checkpoint was made with beta={state['beta']} but this run has "
                f"beta={self.beta}; set correction.beta={state['beta']} (or the same max_staleness "
                "and updates_per_step) to resume"
            )
        self.n = float(state["n"])
        self.resets = int(state["resets"])
        tb = state["theta_bar"]
        self.theta_bar = None if tb is None else [t.detach().to(torch.float32).clone() for t in tb]


METHODS: dict[str, type[Correction]] = {
    cls.method: cls
    for cls in (RolloutLogprobs, TIS, KeepOldActor, EWMA, LogLinearProx, NoCorrection)
}
# What each method does, one line (used by the fail-fast error message).
SUMMARIES = {
    "rollout_logprobs": "anchor = the engine's logprobs μ; no extra forward; the PPO clip absorbs "
    "train/inference discrepancy and staleness together",
    "tis": "anchor = the trainer's weights at the step start; truncated (or masked) importance "
    "weights exp(anchor − μ); one forward per step",
    "keep_old_actor": "anchor = the exact weights that sampled each token (per-version snapshots); "
    "one forward per version in the batch + one weight copy per live version",
    "ewma": "anchor = a moving average of the weights (PPO-EWMA) with a train/inference mask and "
    "reset; one fp32 weight copy + one forward per step",
}
# The last component of _component_ for each method (minippo.rl.correction.<Class>).
CLASS_NAMES = {m: cls.__name__ for m, cls in METHODS.items()}


# --------------------------------------------------------------------------------------------
# Config: the fail-fast contract and construction
# --------------------------------------------------------------------------------------------


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default)


def correction_class(component: str) -> type[Correction]:
    """The class named by a ``_component_`` dotpath, e.g. ``minippo.rl.correction.EWMA``.

    Classes of this module are looked up without importing anything; a dotpath elsewhere is
    imported and must name a subclass of ``Correction``.
    """
    if not isinstance(component, str) or not component:
        raise ValueError(f"correction._component_ must be a dotpath string, got {component!r}")
    if component.startswith(COMPONENT_PREFIX):
        name = component[len(COMPONENT_PREFIX) :]
        for cls in METHODS.values():
            if cls.__name__ == name:
                return cls
        raise ValueError(
            f"correction._component_={component} is not a correction; choose one of "
            f"{[COMPONENT_PREFIX + n for n in CLASS_NAMES.values()]}"
        )
    from minippo.config import locate

    try:
        obj = locate(component, "correction._component_")
    except (ImportError, ValueError) as e:  # locate raises ConfigError, a ValueError
        raise ValueError(f"correction._component_={component} cannot be imported: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, Correction) and obj.method in METHODS):
        raise ValueError(
            f"correction._component_={component} is not a subclass of "
            f"{COMPONENT_PREFIX}Correction with a known method name"
        )
    return obj


def _correction_node(cfg: Any) -> tuple[type[Correction], dict[str, Any]]:
    """(class, options) of ``cfg.correction``; absent or null means ``NoCorrection``."""
    from omegaconf import DictConfig, OmegaConf

    node = _select(cfg, "correction")
    if node is None:
        return NoCorrection, {}
    if not isinstance(node, DictConfig):
        raise ValueError(
            f"correction must be a mapping with a _component_ key, got {node!r}; e.g. "
            f"correction: {{_component_: {COMPONENT_PREFIX}EWMA}}"
        )
    options = OmegaConf.to_container(node, resolve=True)
    component = options.pop("_component_", None)
    if component is None:
        raise ValueError(
            f"correction has no _component_ key (got keys {sorted(options)}); set e.g. "
            f"correction._component_={COMPONENT_PREFIX}EWMA"
        )
    return correction_class(component), options


def _fix_message(reason: str) -> str:
    lines = [
        reason,
        "Set one of these in the config (YAML, or the same key=value on the command line):",
    ]
    for method, summary in SUMMARIES.items():
        lines.append(f"  correction._component_={COMPONENT_PREFIX}{CLASS_NAMES[method]}")
        lines.append(f"      {method}: {summary}")
    lines.append(
        f"e.g. in YAML:  correction: {{_component_: {COMPONENT_PREFIX}KeepOldActor}}. "
        "See docs/corrections.md."
    )
    return "\n".join(lines)


def validate_async_off_policy_correction(cfg: Any) -> str:
    """Fail fast on an async PPO run without a behaviour-policy correction. Returns the method.

    Pure config check (no process group, model or engine); the recipe calls it first. Reads
    ``rollout.max_staleness`` (required int), ``rollout.partial_rollout`` (bool, default false),
    ``advantage_estimator`` (required; "gae" uses a critic, any other value counts as critic-free)
    and ``correction`` (a ``_component_`` node; absent or null means ``none``).

    Raises ValueError when the run is async (max_staleness ≥ 1 or partial rollouts) and uses a
    critic but names no correction (or ``none``), and for unknown or contradictory options.
    Warns (UserWarning) for a critic-free async run with ``none``.
    """
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    max_staleness = _select(cfg, "rollout.max_staleness")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"rollout.max_staleness must be an int >= 0 (0 = synchronous), got {max_staleness!r}"
        )
    partial_rollout = _select(cfg, "rollout.partial_rollout", default=False)
    if not isinstance(partial_rollout, bool):
        raise ValueError(f"rollout.partial_rollout must be true or false, got {partial_rollout!r}")
    estimator = _select(cfg, "advantage_estimator")
    if not isinstance(estimator, str):
        raise ValueError(
            f'advantage_estimator must be set ("gae" with a critic, "grpo" critic-free), got '
            f"{estimator!r}"
        )
    uses_critic = estimator in CRITIC_ESTIMATORS
    is_async = max_staleness >= 1 or partial_rollout

    cls, options = _correction_node(cfg)
    method = cls.method
    check_options(method, options)
    if "max_staleness" in options and options["max_staleness"] != max_staleness:
        raise ValueError(
            f"correction.max_staleness ({options['max_staleness']}) contradicts "
            f"rollout.max_staleness ({max_staleness}); drop correction.max_staleness"
        )

    if is_async and method == "none":
        why = (
            f"rollout.max_staleness={max_staleness}, rollout.partial_rollout={partial_rollout}: "
            "tokens can come from older weights than the trainer's"
        )
        if uses_critic:
            raise ValueError(
                _fix_message(
                    f"Async PPO with a critic (advantage_estimator={estimator}; {why}) needs an "
                    "explicit behaviour-policy correction, but correction is 'none' (the anchor "
                    "would be recomputed with weights that never generated the data)."
                )
            )
        warnings.warn(
            f"Critic-free async run (advantage_estimator={estimator}; {why}) with correction "
            "'none': the PPO anchor is the current weights, not the policy that sampled the "
            f"tokens. Consider correction._component_={COMPONENT_PREFIX}KeepOldActor or "
            f"{COMPONENT_PREFIX}EWMA (docs/corrections.md).",
            UserWarning,
            stacklevel=2,
        )
    return method


def build_correction(
    cfg: Any,
    *,
    temperature: float,
    updates_per_step: int,
    score_fn: ScoreFn | None = None,
    process_group: Any = None,
) -> Correction:
    """Instantiate ``cfg.correction`` (absent or null: ``NoCorrection``).

    Passes ``temperature``, ``updates_per_step`` (ppo.epochs × ppo.minibatches × optimizer steps
    per minibatch), ``rollout.max_staleness`` from ``cfg``, ``score_fn`` and ``process_group``
    to the constructor, with the node's own keys as the method options.
    """
    cls, options = _correction_node(cfg)
    common = {
        "temperature": temperature,
        "max_staleness": int(_select(cfg, "rollout.max_staleness", default=0)),
        "updates_per_step": updates_per_step,
        "score_fn": score_fn,
        "process_group": process_group,
    }
    common.update(options)
    return cls(**common)


__all__ = [
    "EWMA",
    "METHODS",
    "TIS",
    "Correction",
    "CorrectionOutput",
    "KeepOldActor",
    "LogLinearProx",
    "MinibatchCorrection",
    "NoCorrection",
    "RolloutLogprobs",
    "Weights",
    "build_correction",
    "check_options",
    "correction_class",
    "discrepancy_weights",
    "local_shards",
    "loglinear_alpha",
    "loglinear_prox_weights",
    "response_logprobs",
    "staleness_metrics",
    "symmetric_mask_weights",
    "truncated_is_weights",
    "validate_async_off_policy_correction",
]
