"""Per-token logprobs of given tokens without keeping ``[B, S, V]`` float32 logits alive.

The lm_head is applied to the final hidden states chunk by chunk (``chunk_size`` tokens at a time);
each chunk's logits are reduced to one logprob per token at once. With autograd, every chunk runs
under ``torch.utils.checkpoint`` so that its logits are not saved for backward: backward recomputes
them one chunk at a time. Peak extra memory is then O(chunk_size * V) instead of O(B * S * V).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minippo.models.fused_policy_loss import FusedLossSpec, FusedPolicyOutput

if TYPE_CHECKING:
    from minippo.models.packing import PackedLayout
    from minippo.rl.types import RolloutBatch

DEFAULT_CHUNK_SIZE = 1024


@dataclass(frozen=True)
class ScoreSpec:
    """Asks ``Transformer.forward(tokens, score=ScoreSpec(...))`` for the logprobs of
    ``tokens[:, start:]`` at ``temperature`` (and entropies when ``with_entropy``) instead of
    logits, the lm_head applied ``chunk_size`` tokens at a time. Going through ``forward`` keeps
    every module hook working (FSDP2 gathers the lm_head, activation checkpointing, trackers).
    ``entropy_grad``: the entropies carry a gradient (for an entropy term in a loss); without it
    they are computed without autograd, which keeps their intermediates out of backward.
    ``fused``: return the policy loss of these logprobs instead, its gradient formed chunk by
    chunk in the forward pass (a :class:`~minippo.models.fused_policy_loss.FusedPolicyOutput`;
    see :func:`fused_policy_loss`)."""

    start: int = 1
    temperature: float = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    with_entropy: bool = False
    entropy_grad: bool = False
    fused: FusedLossSpec | None = None


def _chunk_logprobs(
    output: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """h [N, D], targets Long[N] -> logprob Float32[N].

    lp = z[t] - logsumexp(z),  z = lm_head(h) / T  (in float32)
    """
    z = output(h).float() / temperature
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _chunk_logprobs_entropy(
    output: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, D], targets Long[N] -> (logprob, entropy) Float32[N] at temperature T.

    H = logsumexp(z) - Σ_v softmax(z)_v z_v

    Without ``grad`` the entropy is computed outside autograd: otherwise a checkpointed chunk
    would recompute its [N, V] softmax in backward and keep it until backward ends whenever the
    caller uses the entropy for logging only (nothing ever reads it), one per chunk.
    """
    z = output(h).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return lp, entropy


def check_score_args(
    input_ids: torch.Tensor, temperature: float, start: int, chunk_size: int
) -> None:
    """Raise ValueError on arguments :func:`token_logprobs` cannot score."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be Long[B, S], got shape {tuple(input_ids.shape)}")
    S = input_ids.shape[1]
    if not 1 <= start < S:
        raise ValueError(f"start ({start}) must satisfy 1 <= start < S ({S})")
    if not temperature > 0:
        raise ValueError(f"temperature ({temperature}) must be > 0 to score tokens")
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of ``targets Long[B, L]`` under ``lm_head(hidden [B, L, D]) / T``, ``Float32[B, L]``
    (and the entropy ``Float32[B, L]`` when ``with_entropy``; with a gradient only when
    ``entropy_grad``), ``chunk_size`` tokens at a time.

    With autograd each chunk is checkpointed, so no chunk's logits are kept for backward.
    """
    B, L, D = hidden.shape
    h = hidden.reshape(B * L, D)
    t = targets.reshape(B * L)
    fn = partial(_chunk_logprobs_entropy, grad=entropy_grad) if with_entropy else _chunk_logprobs
    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    outs = []
    # at least one (maybe empty) chunk: a packed batch may hold no token to score, and its
    # outputs must still hang off the graph for a backward of zeros
    for c in range(0, max(B * L, 1), chunk_size):
        hc, tc = h[c : c + chunk_size], t[c : c + chunk_size]
        if use_ckpt:
            outs.append(checkpoint(fn, lm_head, hc, tc, temperature, use_reentrant=False))
        else:
            outs.append(fn(lm_head, hc, tc, temperature))
    # .clone(): return fresh tensors, not views (FSDP2 hooks the outputs of score for backward,
    # and an in-place op on a view would bypass that hook)
    if with_entropy:
        return (
            torch.cat([o[0] for o in outs]).view(B, L).clone(),
            torch.cat([o[1] for o in outs]).view(B, L).clone(),
        )
    return torch.cat(outs).view(B, L).clone()


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    start: int = 1,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    packed: PackedLayout | None = None,
) -> torch.Tensor:
    """Logprobs of the given tokens, ``Float32[B, S - start]``.

    out[:, j] = log_softmax(logits[:, start - 1 + j] / T)[input_ids[:, start + j]]

    input_ids Long[B, S]; attention_mask Bool[B, S]; position_ids Long[B, S]. With ``start = P``
    (the padded prompt length) this is the response-aligned ``[B, R]`` of a RolloutBatch.
    ``chunk_size`` counts tokens (rows of the flattened ``[B * (S - start)]``) per lm_head chunk.
    ``model`` is a :class:`~minippo.models.Transformer`, plain or FSDP-sharded (the work runs
    inside its ``forward``, see :class:`ScoreSpec`). Values at padding positions are finite but
    meaningless: mask them. ``packed``: a :func:`~minippo.models.packing.pack` layout of the
    batch (made with this ``start``): only real tokens are computed, and padding positions are 0.
    """
    spec = ScoreSpec(start=start, temperature=temperature, chunk_size=chunk_size)
    return _score(model, input_ids, attention_mask, position_ids, spec, packed)


def response_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    packed: PackedLayout | None = None,
) -> torch.Tensor:
    """log π(response token) at every response position of a rollout batch, ``Float32[B, R]``.

    :func:`token_logprobs` with the batch's attention mask and positions, ``start = P`` (the
    padded prompt length) and the sampling ``temperature``. Gradients follow the caller (wrap it in
    ``torch.no_grad()`` for a scoring pass): the reference model's logprobs and the corrections'
    anchors are computed with it. ``packed``: the batch's layout (``pack(mask, start=P)``).
    """
    return token_logprobs(
        model,
        batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        temperature=temperature,
        start=batch.prompt_len,
        packed=packed,
    )


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    start: int = 1,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
    packed: PackedLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`token_logprobs`, plus the entropy of each predictive distribution at
    temperature T: returns ``(logprobs, entropy)``, both ``Float32[B, S - start]``.

    entropy[:, j] = H(softmax(logits[:, start - 1 + j] / T)); it carries a gradient only with
    ``entropy_grad=True`` (an entropy term in a loss). The default (entropy for logging) keeps the
    backward's memory that of the logprobs alone.
    """
    spec = ScoreSpec(start, temperature, chunk_size, with_entropy=True, entropy_grad=entropy_grad)
    return _score(model, input_ids, attention_mask, position_ids, spec, packed)


def fused_policy_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    spec: FusedLossSpec,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    start: int = 1,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    packed: PackedLayout | None = None,
) -> FusedPolicyOutput:
    """The PPO policy loss (+ β·KL) of the tokens ``input_ids[:, start:]``, fused with the lm_head.

    Same value, statistics and gradients as :func:`token_logprobs_and_entropy` followed by
    ``rl.policy_loss`` (+ ``spec.kl_coef`` · ``rl.kl_loss``) with the inputs of ``spec``, but each
    chunk's logits are used once: their gradient into the hidden states and the lm_head weight is
    formed in the forward pass (:mod:`minippo.models.fused_policy_loss`), so backward recomputes
    nothing. Returns a ``FusedPolicyOutput(loss, stats, kl_stats, logprobs, entropy)``.
    """
    score = ScoreSpec(start, temperature, chunk_size, with_entropy=True, fused=spec)
    return _score(model, input_ids, attention_mask, position_ids, score, packed)


def _score(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    spec: ScoreSpec,
    packed: PackedLayout | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | FusedPolicyOutput:
    """``model.forward`` with a :class:`ScoreSpec`: the work of the public scoring functions."""
    return model(
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        score=spec,
        packed=packed,
    )
