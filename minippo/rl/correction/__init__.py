"""Behaviour-policy corrections for asynchronous PPO (the spec: docs/corrections.md).

In async PPO a token was sampled by the engine with weight version v_t, while the trainer now holds
newer weights. Each correction decides the anchor a_t that PPO's ratio r_t = exp(log π_θ − a_t) is
taken against, a per-token weight w_t and a keep-mask k_t:

    method            anchor a_t                          weight w_t / keep k_t
    rollout_logprobs  μ_t (engine logprob)                1 / 1
    tis               log π_{θ_k} (weights at step start)  truncated or masked ρ = exp(a − μ)
                      (one update per step: the training forward's own sg(log π_θ), no pass)
    keep_old_actor    log π_{θ_{v_t}} (exact snapshot)    min(ρ, cap) / 1
    ewma              log π_θ̄ (weight moving average)    ρ on 1/c ≤ ρ ≤ c, else 0 / same
    loglinear_prox    μ + α_t·(sg(log π_θ) − μ)           min(exp(a − μ), cap) / 1
    none              log π_{θ_k}                          1 / 1

The package, by concern:
    weights.py         the pure per-token math (one shared log-ratio), weight statistics
    base.py            ``Correction``: options check, declarations (``WeightCopies``), hooks
    outputs.py         what ``prepare`` returns: ``FixedAnchors``, or anchors that follow the
                       policy (``PolicyAnchors``: ``CurrentAnchors``, ``ProximalAnchors``)
    simple.py          RolloutLogprobs, TIS, LogLinearProx, NoCorrection (no stored weights)
    keep_old_actor.py  KeepOldActor;  ewma.py  EWMA  (weight copies: ``minippo.parallel``)
    contract.py        the fail-fast contract and ``build_correction``

The interface, as the recipe uses it:

    validate_async_off_policy_correction(cfg)      # very first line of the recipe
    corr = build_correction(cfg, temperature=..., updates_per_step=..., score_fn=...)
                                                   # = instantiate(cfg.correction, **provided)
    corr.on_weights_published(0, actor)            # initial weights sample version 0
    for step k:
        out = corr.prepare(batch, actor, step=k)   # once, before the first update of the step
        for epoch, minibatch rows:
            logp = token_logprobs(actor, ...)      # with grad
            mb = out.minibatch(rows, logp)         # anchor, weights, keep-mask of those rows
            loss = policy_loss(logp, mb.anchor_logprobs, adv, mask, weights=mb.weights,
                               keep_mask=mb.keep_mask)
            optimizer.step(); corr.after_optimizer_step(actor)
        publish weights v = k + 1; corr.on_weights_published(k + 1, actor)
        log out.metrics()

``retain(versions)`` and ``release_versions_below(version)`` let the caller evict old-actor
snapshots early; the recipe does not call them (``prepare`` releases what the staleness bound rules
out).

Version convention: version 0 is the initial weights and version k + 1 is published after the
updates of step k, so at the start of step k the actor holds version k and a token's staleness is
k − v_t.

A correction of your own: subclass ``Correction`` anywhere and name it in
``correction._component_`` (docs/corrections.md, "Writing your own correction").
"""

from minippo.rl.correction.base import PROVIDED, Correction, WeightCopies
from minippo.rl.correction.contract import (
    build_correction,
    correction_class,
    validate_async_off_policy_correction,
)
from minippo.rl.correction.ewma import EWMA
from minippo.rl.correction.keep_old_actor import KeepOldActor
from minippo.rl.correction.outputs import (
    CorrectionOutput,
    CurrentAnchors,
    FixedAnchors,
    MinibatchCorrection,
    PolicyAnchors,
    ProximalAnchors,
    TokenAnchors,
)
from minippo.rl.correction.simple import TIS, LogLinearProx, NoCorrection, RolloutLogprobs
from minippo.rl.correction.weights import (
    Weights,
    WeightStats,
    discrepancy_weights,
    log_ratio,
    loglinear_alpha,
    loglinear_prox_weights,
    staleness_metrics,
    symmetric_mask_weights,
    truncated_is_weights,
)

__all__ = [
    "EWMA",
    "PROVIDED",
    "TIS",
    "Correction",
    "CorrectionOutput",
    "CurrentAnchors",
    "FixedAnchors",
    "KeepOldActor",
    "LogLinearProx",
    "MinibatchCorrection",
    "NoCorrection",
    "PolicyAnchors",
    "ProximalAnchors",
    "RolloutLogprobs",
    "TokenAnchors",
    "WeightCopies",
    "WeightStats",
    "Weights",
    "build_correction",
    "correction_class",
    "discrepancy_weights",
    "log_ratio",
    "loglinear_alpha",
    "loglinear_prox_weights",
    "staleness_metrics",
    "symmetric_mask_weights",
    "truncated_is_weights",
    "validate_async_off_policy_correction",
]
