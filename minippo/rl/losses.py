"""PPO policy and value losses (per corrections.md "Notation").

All per-token tensors are response-aligned ``[B, R]``; ``response_mask`` is 1.0 on generated
tokens. Each loss returns ``(loss, stats)``: ``loss`` is this micro-batch's contribution to the
aggregated loss (see ``minippo.rl.aggregation.aggregate``), ``stats`` a NamedTuple of detached
0-dim tensors (``PolicyStats``, ``ValueStats``): nothing here copies a value to the host, so a
training step syncs with the device only when its caller logs (torchtune's ``PPOStats``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minippo.rl.aggregation import aggregate
from minippo.rl.functional import LOG_RATIO_CLAMP, masked_mean, masked_var
from minippo.rl.kl import kl_estimate


def _check_shapes(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if ref.dim() != 2:
        raise ValueError(f"expected response-aligned [B, R] tensors, got shape {tuple(ref.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} (response-aligned "
                "[B, R], like logprobs)"
            )


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest x where mask > 0, 0 when the mask is empty (0-dim, no host sync)."""
    valid = mask > 0
    top = torch.where(valid, x, -torch.inf).amax()
    return torch.where(valid.any(), top, 0.0)


class PolicyStats(NamedTuple):
    """Detached statistics of :func:`policy_loss`, each a 0-dim float tensor over the kept
    response tokens m·k (0 when there are none). Metric names are ``train/<field>``.

    Fields:
        policy_loss     the returned loss value (this micro-batch's share of the minibatch loss)
        clip_frac_low   fraction with A < 0 and r < 1 − ε_low (clipped, no gradient)
        clip_frac_high  fraction with A > 0 and r > 1 + ε_high (clipped, no gradient)
        dual_clip_frac  fraction where the dual clip binds (0 without dual clip)
        approx_kl       k3 estimate of KL(π_θ ‖ anchor): mean of exp(d) − 1 − d, d = a − log π_θ
        ratio_mean      mean of r
        ratio_max       max of r
        kept_frac       Σ m·k / Σ m
    """

    policy_loss: torch.Tensor
    clip_frac_low: torch.Tensor
    clip_frac_high: torch.Tensor
    dual_clip_frac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    kept_frac: torch.Tensor


class ValueStats(NamedTuple):
    """Detached statistics of :func:`value_loss` (0-dim float tensors over response tokens).

    Fields:
        value_loss       the returned loss value (this micro-batch's share)
        value_clip_frac  fraction where the clipped term is larger (the gradient is cut)
        value_mean       mean of V
        returns_mean     mean of the targets R
    """

    value_loss: torch.Tensor
    value_clip_frac: torch.Tensor
    value_mean: torch.Tensor
    returns_mean: torch.Tensor


def as_metrics(stats: NamedTuple, prefix: str = "train/") -> dict[str, torch.Tensor]:
    """``{"train/<field>": value}`` of a stats NamedTuple."""
    return {prefix + k: v for k, v in stats._asdict().items()}


def policy_loss(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, PolicyStats]:
    """Clipped PPO surrogate against an anchor policy, with IS weights and a keep-mask.

    Per token t (m: response_mask, k: keep_mask, w: weights, a: anchor logprob):
        r_t = exp(clamp(log π_θ − a_t, ±20))
        L_t = max(−r_t·A_t, −clip(r_t, 1 − ε_low, 1 + ε_high)·A_t)
        dual clip (c > 1), for A_t < 0:  L_t = min(L_t, −c·A_t)
        loss = aggregate(w_t·k_t·L_t, m, agg_mode)
    The keep-mask only zeroes numerator terms: the denominators count every token of m, so
    rejecting tokens never rescales the remaining ones.

    Args:
        logprobs: float [B, R], log π_θ of the sampled tokens (with grad).
        anchor_logprobs: float [B, R], a_t (no grad; detached here).
        advantages: float [B, R], A_t (no grad; detached here).
        response_mask: [B, R], 1.0 on generated tokens.
        eps_low, eps_high: clip range [1 − ε_low, 1 + ε_high]; ε_low in [0, 1), ε_high ≥ 0.
        dual_clip: c > 1 to bound the loss of negative-advantage tokens, or None.
        weights: float [B, R] per-token weights w_t (no grad; detached here), default 1.
        keep_mask: [B, R] keep-mask k_t (1 keep, 0 reject), default all kept.
        agg_mode, global_tokens, global_seqs: see ``aggregate``.
    Returns:
        loss: float scalar (with grad).
        stats: :class:`PolicyStats` (detached 0-dim tensors).
    """
    _check_shapes(
        logprobs,
        anchor_logprobs=anchor_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        weights=weights,
        keep_mask=keep_mask,
    )
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1) so that 1 - eps_low > 0, got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")

    valid = response_mask > 0
    kept = valid if keep_mask is None else valid & (keep_mask > 0)
    # rejected and padded tokens get neutral inputs (anchor = log π_θ, A = 0, w = 1) so that a
    # non-finite value there cannot produce nan in the forward or the backward pass
    advantages = torch.where(kept, advantages.detach(), 0.0)
    anchor = torch.where(kept, anchor_logprobs.detach(), logprobs.detach())
    if weights is not None:
        weights = torch.where(kept, weights.detach(), 1.0)

    # r_t = exp(log π_θ − a_t), log-ratio clamped to ±20
    log_ratio = (logprobs - anchor).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    # L_t = max(−r·A, −clip(r, 1 − ε_low, 1 + ε_high)·A)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if dual_clip is not None:
        # for A < 0: L = min(L, −c·A)
        dual_bound = -dual_clip * advantages
        dual_binds = (advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, dual_bound), per_token)
    if weights is not None:
        per_token = per_token * weights  # w_t · L_t
    # k_t zeroes the numerator; aggregate's denominators count the full response mask
    per_token = torch.where(kept, per_token, 0.0)
    counts = {"global_tokens": global_tokens, "global_seqs": global_seqs}
    loss = aggregate(per_token, response_mask, agg_mode, **counts)

    with torch.no_grad():
        kept_f = kept.to(logprobs.dtype)
        r = ratio.detach()
        lp = logprobs.detach()  # k3 of d = clamp(a − log π_θ, ±20), the log-ratio clamped above
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        stats = PolicyStats(
            policy_loss=loss.detach(),
            clip_frac_low=masked_mean(((advantages < 0) & (r < 1.0 - eps_low)).to(r.dtype), kept_f),
            clip_frac_high=masked_mean(
                ((advantages > 0) & (r > 1.0 + eps_high)).to(r.dtype), kept_f
            ),
            dual_clip_frac=(
                masked_mean(dual_binds.to(r.dtype), kept_f) if dual_clip is not None else zero
            ),
            approx_kl=masked_mean(kl_estimate(lp, anchor, "k3"), kept_f),
            ratio_mean=masked_mean(r, kept_f),
            ratio_max=_masked_max(r, kept_f),
            kept_frac=kept_f.sum() / valid.sum().clamp(min=1),
        )
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.2,
    coef: float = 1.0,
    half: bool = True,
    agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, ValueStats]:
    """Clipped value loss around the old values.

    Per token (ε = clip_range, c = coef, h = 1/2 when ``half`` else 1):
        V_clip = V_old + clamp(V − V_old, −ε, ε)
        L_t = c · h · max((V − R)², (V_clip − R)²)      (no clipping: c · h · (V − R)²)
        loss = aggregate(L, m, agg_mode)

    Args:
        values: float [B, R], V from the critic being trained (with grad).
        old_values: float [B, R], V_old, the critic's values when advantages were computed.
        returns: float [B, R], R, the regression targets (e.g. GAE returns).
        response_mask: [B, R], 1.0 on generated tokens.
        clip_range: ε > 0, or None to disable clipping.
        coef: loss coefficient c ≥ 0 (multiplies the loss and its gradient).
        half: include the 1/2 factor (so that the gradient of (V − R)² / 2 is V − R).
        agg_mode, global_tokens, global_seqs: see ``aggregate``.
    Returns:
        loss: float scalar (with grad).
        stats: :class:`ValueStats` (detached 0-dim tensors over response tokens).
    """
    _check_shapes(values, old_values=old_values, returns=returns, response_mask=response_mask)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 (or None to disable), got {clip_range}")
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    # padded positions get neutral targets so a non-finite value there cannot reach the gradient
    valid = response_mask > 0
    old_values = torch.where(valid, old_values.detach(), values.detach())
    returns = torch.where(valid, returns.detach(), values.detach())
    # (V − R)²
    loss_unclipped = (values - returns) ** 2
    if clip_range is not None:
        # V_clip = V_old + clamp(V − V_old, −ε, ε);  L = max((V − R)², (V_clip − R)²)
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        loss_clipped = (v_clip - returns) ** 2
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    else:
        per_token = loss_unclipped
        clipped = torch.zeros_like(values, dtype=torch.bool)
    per_token = coef * (0.5 if half else 1.0) * per_token
    counts = {"global_tokens": global_tokens, "global_seqs": global_seqs}
    loss = aggregate(per_token, response_mask, agg_mode, **counts)
    with torch.no_grad():
        stats = ValueStats(
            value_loss=loss.detach(),
            value_clip_frac=masked_mean(clipped.to(values.dtype), response_mask),
            value_mean=masked_mean(values.detach(), response_mask),
            returns_mean=masked_mean(returns, response_mask),
        )
    return loss, stats


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """Explained variance of the critic over response tokens: 1 − Var[R − V] / Var[R].

    1 is a perfect critic, 0 is no better than predicting the mean return, < 0 is worse.
    Variances are unbiased and masked. Returns ``nan`` when Var[R] = 0 (undefined: e.g. every
    return equal, or fewer than 2 tokens), so a constant target is never reported as a score.

    Args:
        values, returns: float [B, R]; response_mask: [B, R].
    """
    _check_shapes(values, returns=returns, response_mask=response_mask)
    with torch.no_grad():
        var_returns = float(masked_var(returns.double(), response_mask))
        if var_returns == 0.0:
            return float("nan")
        var_residual = float(masked_var((returns - values).double(), response_mask))
        return 1.0 - var_residual / var_returns


def near_zero_fraction(
    advantages: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor, rtol: float = 1e-3
) -> float:
    """The share of response tokens whose advantage is about 0: |A| ≤ rtol × (max − min of the
    batch's rewards). Such tokens carry no learning signal (GRPO: every sample of their group
    scored the same; GAE: the critic predicted the outcome). A share that climbs while the reward
    is flat below its maximum is a run that has stopped learning (docs/learning.md).

    Args:
        advantages: float [B, R], before whitening; response_mask: [B, R]; rewards: float [B].
    """
    _check_shapes(advantages, response_mask=response_mask)
    with torch.no_grad():
        valid = response_mask > 0
        n = int(valid.sum())
        if n == 0:
            return float("nan")
        tol = rtol * float(rewards.max() - rewards.min()) if rewards.numel() else 0.0
        return float((valid & (advantages.abs() <= tol)).sum()) / n
