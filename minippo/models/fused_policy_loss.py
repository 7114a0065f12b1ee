"""Fused lm_head + PPO policy loss: the gradient is formed in the forward pass, chunk by chunk.

The policy loss (``rl.policy_loss``, plus β·``rl.kl_loss`` when the KL is a loss term) depends on
the model only through each response token's logprob lp_t, and its derivative with respect to
lp_t has a closed form in lp_t, the anchor, the advantage, the weight and the clip. So each chunk
of ``chunk_size`` tokens computes its logits z = lm_head(h) / T, the logprob and entropy, the
token gradient g_t = ∂loss/∂lp_t, and at once that chunk's gradients into the hidden states and
the lm_head weight,

    ∂loss/∂z_t = g_t · (onehot(y_t) − p_t) + η · c_t · p_t ⊙ (log p_t + H_t),
    ∂loss/∂logits = ∂loss/∂z / T,

then frees the logits (p_t = softmax(z_t), H_t its entropy; the second term is the gradient of
the entropy bonus −η·aggregate(H), present when ``entropy_coef`` η > 0). Backward only scales the
saved gradients by the incoming one: no chunk is recomputed (:mod:`minippo.models.logprobs`
checkpoints every chunk and recomputes it instead).

Token gradient (m: response mask, k: keep-mask, w: weight, a: anchor, A: advantage, c_t: the
aggregation coefficient ∂aggregate/∂L_t of ``rl.aggregate`` with the global counts, r = exp(ρ),
ρ = clamp(lp − a, ±20), the conventions of torch's autograd at ties kept):

    ∂L/∂lp   = −A · r · [|lp − a| ≤ 20] · [−r·A ≥ −clip(r)·A]           (the clipped side: 0)
    dual clip (A < 0): × 1 if L < −c·A, 1/2 if L = −c·A, 0 if L > −c·A
    KL, d = clamp(ref − lp, ±20):  k1: [|d| ≤ 20];  k2: −d·[|d| ≤ 20];  k3: −expm1(d)·[|d| ≤ 20]
    g_t = c_t · (m_t·k_t · w_t · ∂L/∂lp + β · m_t · ∂kl/∂lp)

The loss value and the statistics come from ``rl.policy_loss`` / ``rl.kl_loss`` applied to the
(detached) logprobs, so they are the unfused path's numbers.

Anchors that follow the policy (``token_anchors``, e.g. ``tis`` with one update per step, whose
anchor is the training forward's own sg(lp)) are formed from each chunk's logprobs before its token
gradient: a, w and k of a token depend on its own logprob only, so nothing is scored twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from minippo.rl.aggregation import aggregate
from minippo.rl.functional import LOG_RATIO_CLAMP
from minippo.rl.kl import KL_ESTIMATORS, KLStats, kl_loss
from minippo.rl.losses import PolicyStats, policy_loss


@dataclass(frozen=True)
class FusedLossSpec:
    """The policy-loss inputs of a fused scoring pass (``ScoreSpec(fused=...)``); the per-token
    tensors are response-aligned ``[B, R]`` like the logprobs they score, and detached here.

    Fields: ``anchor_logprobs``, ``advantages``, ``response_mask``, ``weights`` (None: 1),
    ``keep_mask`` (None: all kept), ``eps_low``, ``eps_high``, ``dual_clip``, ``agg_mode``,
    ``global_tokens``, ``global_seqs``: as in ``rl.policy_loss``; ``ref_logprobs`` (None: no KL
    term), ``kl_estimator``, ``kl_coef``: the β·``rl.kl_loss`` term added to the loss;
    ``entropy_coef`` η: the entropy bonus −η·``rl.aggregate(entropy, response_mask)`` added to it.
    ``token_anchors``: instead of ``anchor_logprobs``, ``weights`` and ``keep_mask`` (all None
    then), ``(lp Float32[n], sl) -> (anchor, weight, keep)`` of the flattened ``[B·R]`` tokens
    ``sl`` from their detached logprobs, token by token (``PolicyAnchors.token_anchors``).
    """

    anchor_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    response_mask: torch.Tensor
    weights: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    agg_mode: str = "token-mean"
    global_tokens: float | torch.Tensor | None = None
    global_seqs: float | torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    token_anchors: (
        Callable[[torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None
    ) = None


class FusedPolicyOutput(NamedTuple):
    """What a fused scoring pass returns.

    Fields:
        loss       scalar with grad: this micro-batch's policy loss (+ β·KL loss − η·entropy)
        stats      :class:`~minippo.rl.PolicyStats` of ``rl.policy_loss`` (policy term only)
        kl_stats   :class:`~minippo.rl.KLStats` of ``rl.kl_loss`` (None without a KL term)
        logprobs   Float32[B, R], detached
        entropy    Float32[B, R], detached
    """

    loss: torch.Tensor
    stats: PolicyStats
    kl_stats: KLStats | None
    logprobs: torch.Tensor
    entropy: torch.Tensor


def _token_grad(lp: torch.Tensor, t: dict[str, torch.Tensor], spec: FusedLossSpec) -> torch.Tensor:
    """g_t = ∂loss/∂lp_t of one chunk (Float32[n]); ``t`` holds the chunk's prepared inputs."""
    kept, adv, anchor, w, coef = t["kept"], t["adv"], t["anchor"], t["w"], t["coef"]
    diff = lp - anchor
    in_range = (diff >= -LOG_RATIO_CLAMP) & (diff <= LOG_RATIO_CLAMP)
    ratio = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -ratio * adv
    loss_clipped = -ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high) * adv
    # ∂L/∂r = −A where the unclipped term is the max (ties: both sides carry −A or A = 0)
    grad = torch.where(in_range & (loss_unclipped >= loss_clipped), -adv * ratio, 0.0)
    if spec.dual_clip is not None:
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        bound = -spec.dual_clip * adv
        # torch.minimum: the smaller side takes the gradient, a tie splits it in halves
        share = torch.where(per_token < bound, 1.0, torch.where(per_token == bound, 0.5, 0.0))
        grad = torch.where(adv < 0, grad * share, grad)
    g = torch.where(kept, coef * (w * grad), 0.0)
    if spec.ref_logprobs is not None and spec.kl_coef != 0.0:
        d = t["ref"] - lp
        d_in = (d >= -LOG_RATIO_CLAMP) & (d <= LOG_RATIO_CLAMP)
        dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if spec.kl_estimator == "k1":
            dkl = torch.ones_like(dc)
        elif spec.kl_estimator == "k2":
            dkl = -dc
        else:
            dkl = -torch.expm1(dc)
        g = g + torch.where(t["valid"] & d_in, spec.kl_coef * (coef * dkl), 0.0)
    return g


def _agg_coef(spec: FusedLossSpec, like: torch.Tensor) -> torch.Tensor:
    """c_t = ∂aggregate(L, m)/∂L_t (the aggregation's own autograd: the unfused coefficients)."""
    with torch.enable_grad():
        x = torch.zeros_like(like, dtype=torch.float32, requires_grad=True)
        out = aggregate(
            x,
            spec.response_mask,
            spec.agg_mode,
            global_tokens=spec.global_tokens,
            global_seqs=spec.global_seqs,
        )
        (coef,) = torch.autograd.grad(out, x)
    return coef


def _masked(
    t: dict[str, torch.Tensor],
    anchor: torch.Tensor,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """``t`` with the anchor, weight and keep-mask inputs set; rejected and padded tokens get
    finite neutral values (advantage 0, anchor 0, weight 1)."""
    valid = t["valid"]
    kept = valid if keep is None else valid & (keep > 0)
    zero = torch.zeros_like(t["adv_raw"])
    return {
        **t,
        "kept": kept,
        "adv": torch.where(kept, t["adv_raw"], zero),
        "anchor": torch.where(kept, anchor.detach(), zero),
        "w": zero + 1.0 if weights is None else torch.where(kept, weights.detach(), 1.0),
    }


def _prepare(
    spec: FusedLossSpec, shape: torch.Size, positions: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Per-token inputs of the N scored tokens (the anchors' ones left to each chunk with
    ``token_anchors``): the flattened ``[B·R]``, or with ``positions`` those entries only."""
    m = spec.response_mask
    zero = torch.zeros(shape, dtype=torch.float32, device=m.device)
    # dtypes as the unfused ops promote them (float32 logprobs with float32 or wider inputs)
    out = {
        "valid": m > 0,
        "adv_raw": zero + spec.advantages.detach(),
        "coef": _agg_coef(spec, zero),
    }
    if spec.ref_logprobs is not None:
        out["ref"] = torch.where(out["valid"], spec.ref_logprobs.detach(), zero)
    if spec.token_anchors is None:
        out = _masked(out, spec.anchor_logprobs, spec.weights, spec.keep_mask)
    if positions is None:
        return {k: v.reshape(-1) for k, v in out.items()}
    return {k: v.reshape(-1)[positions] for k, v in out.items()}


def _chunk_inputs(
    prep: dict[str, torch.Tensor],
    sl: slice,
    lp: torch.Tensor,
    spec: FusedLossSpec,
    positions: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The inputs of the chunk ``sl``; anchors that follow the policy formed from its ``lp``
    (handed the chunk's places in the flattened ``[B·R]``: ``sl`` itself, or ``positions[sl]``)."""
    t = {k: v[sl] for k, v in prep.items()}
    if spec.token_anchors is None:
        return t
    return _masked(t, *spec.token_anchors(lp, sl if positions is None else positions[sl]))


class _FusedPolicyLoss(torch.autograd.Function):
    """(h [N, D], W [V, D]) -> (loss, logprobs [N], entropy [N]); see the module docstring."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, chunk_size, prep, spec, finish, positions):
        N = h.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        lp_all = torch.empty(N, dtype=torch.float32, device=h.device)
        ent_all = torch.empty(N, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights: fp32 sums
        grad_w = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for c in range(0, N, chunk_size):
            sl = slice(c, min(c + chunk_size, N))
            hc, tc = h[sl], targets[sl]
            # the F.linear of lm_head (no bias); the chunk holds two [n, V] float32 tensors, z and
            # p (in-place ops, and the entropy's row dots as a batched matmul, make no third)
            z = F.linear(hc, weight).float()
            z = z.div_(temperature)
            lse = torch.logsumexp(z, dim=-1)
            lp = z.gather(-1, tc[:, None]).squeeze(-1) - lse
            p = torch.softmax(z, dim=-1)
            ent = lse - torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
            ent_all[sl], lp_all[sl] = ent, lp
            if not need_grad:
                continue
            # g in the logprobs' float32, as autograd hands it to the logprob's own backward
            t = _chunk_inputs(prep, sl, lp, spec, positions)
            g = _token_grad(lp, t, spec).to(lp.dtype)
            # the entropy bonus's η·c·p ⊙ (z − lse + H), in z's place (log p = z − lse)
            dent = None
            if spec.entropy_coef != 0.0:
                scale = spec.entropy_coef * t["coef"]  # c_t is 0 off the response mask
                dent = z.sub_((lse - ent)[:, None]).mul_(p).mul_(scale[:, None])
            del z
            # ∂loss/∂logits = g · (onehot − p) / T, then in the lm_head's dtype (autograd's order)
            dz = p.mul_(-g[:, None])
            dz.scatter_add_(-1, tc[:, None], g[:, None])
            if dent is not None:
                dz.add_(dent)
                del dent
            dz = dz.div_(temperature).to(h.dtype)
            del p
            if grad_h is not None:
                torch.matmul(dz, weight, out=grad_h[sl])
            if grad_w is not None:
                if grad_w.dtype == dz.dtype:
                    grad_w.addmm_(dz.t(), hc)
                else:
                    grad_w += (dz.t() @ hc).to(acc)
            del dz
        loss = finish(lp_all, ent_all)
        # kept on ctx (not saved tensors): backward scales them in place and hands them over
        ctx.grad_h = grad_h
        ctx.grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        ctx.mark_non_differentiable(lp_all, ent_all)
        return loss, lp_all, ent_all

    @staticmethod
    def backward(ctx, grad_loss, _grad_lp, _grad_ent):
        gh, gw = ctx.grad_h, ctx.grad_w
        ctx.grad_h = ctx.grad_w = None  # a second backward through this graph has nothing left
        if gh is None and gw is None:
            raise RuntimeError(
                "the fused policy loss was already backpropagated (its gradients are formed once)"
            )
        gh = None if gh is None else gh.mul_(grad_loss.to(gh.dtype))
        gw = None if gw is None else gw.mul_(grad_loss.to(gw.dtype))
        return gh, gw, None, None, None, None, None, None, None


def check_fused_spec(spec: FusedLossSpec, shape: torch.Size) -> None:
    """Raise ValueError on fused-loss inputs ``rl.policy_loss`` / ``rl.kl_loss`` would refuse."""
    fixed = (spec.anchor_logprobs, spec.weights, spec.keep_mask)
    if spec.token_anchors is not None and any(t is not None for t in fixed):
        raise ValueError(
            "fused loss: token_anchors replaces anchor_logprobs, weights and keep_mask; leave "
            "those None"
        )
    if spec.token_anchors is None and spec.anchor_logprobs is None:
        raise ValueError("fused loss: set anchor_logprobs (or token_anchors)")
    for name in ("anchor_logprobs", "advantages", "response_mask", "weights", "keep_mask"):
        t = getattr(spec, name)
        if t is not None and t.shape != shape:
            raise ValueError(f"fused loss: {name} has shape {tuple(t.shape)}, expected {shape}")
    if spec.ref_logprobs is not None and spec.ref_logprobs.shape != shape:
        raise ValueError(
            f"fused loss: ref_logprobs has shape {tuple(spec.ref_logprobs.shape)}, expected {shape}"
        )
    if spec.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {spec.kl_estimator!r}; use one of {KL_ESTIMATORS}")


def fused_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    spec: FusedLossSpec,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    positions: torch.Tensor | None = None,
) -> FusedPolicyOutput:
    """The policy loss (+ β·KL) of ``targets Long[B, R]`` under ``hidden [B, R, D] @ weight.T / T``
    with its gradient into ``hidden`` and ``weight`` formed in this call (see the module
    docstring). ``weight`` is the lm_head weight as the model's forward sees it (under FSDP2 the
    gathered one: call this inside the model's forward, as ``Transformer.forward`` does).

    Packed input: ``hidden [n, D]`` and ``targets Long[n]`` of n scored tokens only, and
    ``positions Long[n]``, each one's index into the flattened ``[B·R]`` of the spec's tensors
    (whose shape gives B and R); the other positions count as padding (their logprob is 0, and
    ``spec.response_mask`` must be 0 there). Loss, statistics and outputs are then those of the
    ``[B, R]`` tensors with the n logprobs in place."""
    shape = spec.response_mask.shape
    if positions is None:
        B, R, D = hidden.shape
        shape = torch.Size((B, R))
        hidden, targets = hidden.reshape(B * R, D), targets.reshape(B * R)
    elif not (hidden.dim() == 2 and targets.shape == positions.shape == hidden.shape[:1]):
        raise ValueError(
            f"fused loss: packed input needs hidden [n, D], targets [n] and positions [n], got "
            f"{tuple(hidden.shape)}, {tuple(targets.shape)}, {tuple(positions.shape)}"
        )
    check_fused_spec(spec, shape)
    B, R = shape
    prep = _prepare(spec, shape, positions)
    out: dict = {}

    def full(x: torch.Tensor) -> torch.Tensor:
        """[n] values of the scored tokens -> [B, R], 0 elsewhere."""
        if positions is None:
            return x.view(B, R)
        return x.new_zeros(B * R).index_put_((positions,), x).view(B, R)

    def finish(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        # the unfused functions on the detached logprobs: same loss value, same statistics
        logp = full(lp)
        anchors = (spec.anchor_logprobs, spec.weights, spec.keep_mask)
        if spec.token_anchors is not None:
            anchors = tuple(x.view(B, R) for x in spec.token_anchors(logp.reshape(-1), slice(None)))
        loss, stats = policy_loss(
            logp,
            anchors[0],
            spec.advantages,
            spec.response_mask,
            eps_low=spec.eps_low,
            eps_high=spec.eps_high,
            dual_clip=spec.dual_clip,
            weights=anchors[1],
            keep_mask=anchors[2],
            agg_mode=spec.agg_mode,
            global_tokens=spec.global_tokens,
            global_seqs=spec.global_seqs,
        )
        out["stats"], out["kl_stats"] = stats, None
        if spec.ref_logprobs is not None:
            kl, kst = kl_loss(
                logp,
                spec.ref_logprobs,
                spec.response_mask,
                spec.kl_estimator,
                agg_mode=spec.agg_mode,
                global_tokens=spec.global_tokens,
                global_seqs=spec.global_seqs,
            )
            loss = loss + spec.kl_coef * kl
            out["kl_stats"] = kst
        if spec.entropy_coef != 0.0:
            loss = loss - spec.entropy_coef * aggregate(
                full(ent),
                spec.response_mask,
                spec.agg_mode,
                global_tokens=spec.global_tokens,
                global_seqs=spec.global_seqs,
            )
        return loss.detach().clone()

    loss, lp, ent = _FusedPolicyLoss.apply(
        hidden, weight, targets, temperature, chunk_size, prep, spec, finish, positions
    )
    return FusedPolicyOutput(loss, out["stats"], out["kl_stats"], full(lp), full(ent))
