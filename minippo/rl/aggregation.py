"""Loss aggregation over response tokens that stays exact under gradient accumulation and DP.

A per-token loss ``L [B, R]`` and the response mask ``m [B, R]`` (1.0 on generated tokens) are
reduced to a scalar in one of three modes (N_tok = Σ m, N_seq = number of rows with Σ_t m > 0):

    token-mean            Σ_{b,t} m·L / N_tok
    seq-mean-token-mean   (1 / N_seq) Σ_b [ Σ_t m·L / Σ_t m ]
    seq-mean-token-sum    (1 / N_seq) Σ_b Σ_t m·L

The denominators are the counts of the WHOLE optimizer-step batch (all micro-batches on all
ranks), passed in as ``global_tokens`` / ``global_seqs``. Each call then returns this micro-batch's
contribution, and the contributions of all micro-batches and ranks SUM to the full-batch value
(the per-sequence token count Σ_t m of seq-mean-token-mean is always complete, because a row is
never split across micro-batches). See docs/rl.md for what to pass under FSDP.

Why ``torch.distributed`` is imported here: ``global_counts`` all-reduces the counts of a
minibatch over the ranks, which is what makes the denominators global.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


class GlobalCounts(NamedTuple):
    """Token and sequence counts of a batch summed over every rank of the group.

    Fields (0-dim float32 tensors on the mask's device, exact integers: kept on the device so that
    loss normalisation never waits for the host):
        tokens: N_tok = Σ m over all response tokens (the token-mean denominator)
        seqs:   N_seq = number of rows with at least one response token
    """

    tokens: torch.Tensor
    seqs: torch.Tensor


def global_counts(mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> GlobalCounts:
    """Counts of the mask, all-reduced (sum) over ``group`` when torch.distributed is initialised.

    Call it once per optimizer step with the mask of this rank's whole minibatch (all its
    micro-batches), then pass the result to every ``aggregate`` call of that step.

    Args:
        mask: [B, R] response mask (1.0 on generated tokens; read as mask > 0).
        group: process group to sum over (None: the default group). Without an initialised
            process group the local counts are returned.
    Returns:
        GlobalCounts(tokens, seqs), 0-dim float32 tensors (exact integers up to 2^24 tokens).
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, R], got shape {tuple(mask.shape)}")
    valid = mask > 0
    counts = torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.int64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    tokens, seqs = counts.to(torch.float32).unbind()
    return GlobalCounts(tokens=tokens, seqs=seqs)


def _check_global(name: str, value: float | torch.Tensor, valid: torch.Tensor) -> None:
    """A Python-number global count must cover this micro-batch's own count. A tensor count
    (from :func:`global_counts`) is not checked: that would wait for the device on every call."""
    if isinstance(value, torch.Tensor):
        return
    local = int(valid.sum()) if name == "global_tokens" else int(valid.any(dim=-1).sum())
    if value < local:
        raise ValueError(
            f"{name} ({value}) is smaller than this micro-batch's own count ({local}); pass the "
            "count of the whole optimizer-step batch over all ranks (see global_counts)"
        )


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the aggregated loss.

    Args:
        per_token_loss: float [B, R], L_t (entries where mask == 0 are ignored, even if nan).
        mask: [B, R] response mask; the denominators count it (read as mask > 0).
        mode: one of "token-mean", "seq-mean-token-mean", "seq-mean-token-sum".
        global_tokens: N_tok of the whole optimizer-step batch (token-mean only).
        global_seqs: N_seq of the whole optimizer-step batch (seq-mean-* modes).
            With both None the local counts are used: the plain mean of this batch alone.
            Python numbers are checked against this micro-batch's own count; the tensors of
            :func:`global_counts` are used as they are (no host sync).
    Returns:
        float scalar: Σ (numerator over this micro-batch) / (global denominator). A zero count
        gives 0 (the denominator is floored at 1), never nan.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; use one of {AGGREGATION_MODES}")
    if per_token_loss.shape != mask.shape or per_token_loss.dim() != 2:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} must "
            "both be [B, R]"
        )
    use_global = global_tokens is not None or global_seqs is not None
    valid = mask > 0
    # masked-out entries are replaced (not multiplied) by 0, so a nan there cannot leak
    x = torch.where(valid, per_token_loss, 0.0)

    if mode == "token-mean":
        if use_global and global_tokens is None:
            raise ValueError("mode 'token-mean' needs global_tokens (global_seqs alone was given)")
        if global_tokens is not None:
            _check_global("global_tokens", global_tokens, valid)
        n_tok = global_tokens if global_tokens is not None else valid.sum()
        # Σ_{b,t} m·L / N_tok
        return x.sum() / _at_least_one(n_tok, x)

    tokens_per_seq = valid.sum(dim=-1)  # Σ_t m, complete: rows are never split
    seq_sum = x.sum(dim=-1)  # Σ_t m·L
    if mode == "seq-mean-token-mean":
        seq_value = seq_sum / tokens_per_seq.clamp(min=1)  # Σ_t m·L / Σ_t m
    else:
        seq_value = seq_sum
    if use_global and global_seqs is None:
        raise ValueError(f"mode {mode!r} needs global_seqs (global_tokens alone was given)")
    if global_seqs is not None:
        _check_global("global_seqs", global_seqs, valid)
    n_seq = global_seqs if global_seqs is not None else (tokens_per_seq > 0).sum()
    # (1 / N_seq) Σ_b seq_value_b
    return seq_value.sum() / _at_least_one(n_seq, x)


def _at_least_one(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """max(count, 1) as a tensor of ``like``'s dtype and device (a zero count gives 0, not nan)."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
