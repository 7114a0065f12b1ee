"""Advantage estimators: masked GAE (with a critic) and group-normalised advantages (GRPO).

Conventions: per-token tensors are response-aligned ``[B, R]`` (column j is response token j);
``response_mask`` is 1.0 on generated tokens and 0.0 on padding (read as mask > 0). Position t of
``values`` is V(s_t), the critic's value of the state BEFORE response token t is emitted, i.e. the
critic output at sequence position P + t − 1 (``split_critic_values`` cuts it from the critic).
"""

from __future__ import annotations

import torch

# The advantage estimators the recipe offers (``advantage_estimator``), and whether each trains a
# critic. The one place that decides it: the recipe, the correction contract and the planner read it.
ADVANTAGE_ESTIMATORS: dict[str, bool] = {"gae": True, "grpo": False}


def needs_critic(estimator: str) -> bool:
    """Whether ``advantage_estimator=estimator`` trains a value model (an unknown name raises)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage_estimator must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {estimator!r}"
        )
    return ADVANTAGE_ESTIMATORS[estimator]


def _check_2d(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if t.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (response-aligned [B, R])"
        )


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last generated token of each row.

    Args:
        response_mask: [B, R]
    Returns:
        int64 [B]: the largest t with mask[b, t] > 0; -1 for a row without response tokens.
    """
    valid = response_mask > 0
    R = valid.shape[-1]
    # first True in the flipped row is the last True in the row
    last = R - 1 - valid.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(valid.any(dim=-1), last, torch.full_like(last, -1))


def place_sequence_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's scalar reward on its last generated token.

    Args:
        rewards: float [B], the sequence reward.
        response_mask: [B, R]
    Returns:
        float [B, R]: out[b, last_b] = rewards[b], 0 elsewhere. A row without any response
        token has nowhere to hold its reward and is all zeros.
    """
    if rewards.dim() != 1 or response_mask.dim() != 2 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"rewards must be [B] and response_mask [B, R] with the same B; got "
            f"{tuple(rewards.shape)} and {tuple(response_mask.shape)}"
        )
    last = last_token_index(response_mask)
    out = torch.zeros(response_mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def split_critic_values(
    critic_values: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-aligned values and the bootstrap value from the critic's per-position output.

    With P = S − R: values[:, t] = critic_values[:, P + t − 1] (the state before token t), and
    bootstrap[b] = critic_values[b, P + last_b], the state after the last generated token (what
    GAE bootstraps from for a row cut by max_new_tokens). Rows without response tokens get
    bootstrap 0.

    Args:
        critic_values: float [B, P + R], ValueModel output over the full sequence (P ≥ 1).
        response_mask: [B, R]
    Returns:
        values: float [B, R]; bootstrap: float [B]
    """
    B, S = critic_values.shape
    R = response_mask.shape[-1]
    P = S - R
    if response_mask.shape[0] != B or P < 1:
        raise ValueError(
            f"critic_values [B, P + R] = {tuple(critic_values.shape)} does not fit "
            f"response_mask [B, R] = {tuple(response_mask.shape)} with a prompt of P >= 1 tokens"
        )
    values = critic_values[:, P - 1 : P + R - 1]
    last = last_token_index(response_mask)
    boot = critic_values.gather(1, (P + last.clamp(min=0)).unsqueeze(-1)).squeeze(-1)
    boot = torch.where(last >= 0, boot, 0.0)
    return values, boot


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    truncated: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
    bootstrap_truncated: bool = True,
    value_lam: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, skipping masked positions.

    Backwards over t, only over generated tokens (m_t > 0); a masked position is not a transition
    and carries the next value and the running advantage through unchanged:
        δ_t = r_t + γ·V_next − V_t
        A_t = δ_t + γλ·A_next
        V_next ← V_t,  A_next ← A_t
    The value after the last generated token (the initial V_next) is 0 for a finished response,
    and ``bootstrap_values[b]`` for a row with ``truncated[b]`` when ``bootstrap_truncated``: a
    response cut by max_new_tokens did not end, so its tail is estimated by the critic. With
    ``bootstrap_truncated=False`` truncated rows are treated as finished (value 0 after the cut,
    appropriate when the reward already scores the cut text as final).

    ``value_lam`` decouples the critic's targets from the policy's advantages: the returns are
    then the λ-returns of ``value_lam`` (A_t computed with value_lam, + V_t), while the advantages
    keep ``lam``. ``value_lam = 1`` gives Monte-Carlo targets (the reward to go), which do not
    lean on the critic's own early, poor values; ``None`` uses ``lam`` for both.

    Args:
        values: float [B, R], V(s_t) (no grad; detached here).
        rewards: float [B, R], per-token rewards (e.g. place_sequence_rewards − β·KL).
        response_mask: [B, R]
        gamma: discount γ in [0, 1]; lam: GAE λ in [0, 1].
        value_lam: the λ of the returns in [0, 1], or None (= lam).
        truncated: bool [B], rows cut by max_new_tokens (None: none).
        bootstrap_values: float [B], V of the state after each row's last token
            (``split_critic_values``); required when any row is truncated and
            ``bootstrap_truncated``.
        bootstrap_truncated: bootstrap truncated rows from the critic (True) or from 0 (False).
    Returns:
        advantages: float [B, R]; returns: float [B, R] = A_t + V_t (A_t of ``value_lam`` when
        given). Both 0 on masked positions.
    """
    shape = response_mask.shape
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(shape)}")
    _check_2d("values", values, shape)
    _check_2d("rewards", rewards, shape)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if value_lam is not None and not 0.0 <= value_lam <= 1.0:
        raise ValueError(f"value_lam must be in [0, 1] or None, got {value_lam}")
    B = shape[0]
    values = values.detach()
    rewards = rewards.detach()
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    if truncated is not None:
        if truncated.shape != (B,):
            raise ValueError(f"truncated must be [B] = ({B},), got {tuple(truncated.shape)}")
        if bootstrap_truncated and bool(truncated.any()):
            if bootstrap_values is None:
                raise ValueError(
                    "some rows are truncated and bootstrap_truncated=True, but bootstrap_values "
                    "is None; pass the critic's value after the last token "
                    "(split_critic_values) or set bootstrap_truncated=False"
                )
            if bootstrap_values.shape != (B,):
                raise ValueError(
                    f"bootstrap_values must be [B] = ({B},), got {tuple(bootstrap_values.shape)}"
                )
            next_value = torch.where(
                truncated.bool(), bootstrap_values.detach().to(values.dtype), next_value
            )

    valid = response_mask > 0
    advantages = _gae_scan(values, rewards, valid, next_value, gamma, lam)
    if value_lam is not None and value_lam != lam:
        returns = _gae_scan(values, rewards, valid, next_value, gamma, value_lam) + values
    else:
        returns = advantages + values
    return advantages, torch.where(valid, returns, 0.0)


def _gae_scan(
    values: torch.Tensor,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """The backward GAE recursion of :func:`gae` (``next_value``: V after each row's last token)."""
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = valid[:, t]
        # δ_t = r_t + γ·V_next − V_t ;  A_t = δ_t + γλ·A_next
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # masked positions carry V_next and A_next through unchanged
        next_adv = torch.where(m, adv_t, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = torch.where(m, adv_t, 0.0)
    return advantages


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Critic-free group-normalised advantages (GRPO), broadcast over the response tokens.

    For sample i in group g (all samples with the same group id, i.e. the same prompt):
        A_i = (r_i − mean_g) / (std_g + eps)     (normalize_std=True; std unbiased, n − 1)
        A_i =  r_i − mean_g                      (normalize_std=False, "Dr. GRPO")
    A group whose rewards are all equal (std 0, including a group of one sample) gets advantage
    exactly 0: it carries no learning signal, and never nan. Groups may have different sizes.

    Args:
        rewards: float [B], sequence rewards.
        group_ids: int64 [B], the prompt index of each sample.
        response_mask: [B, R]
        normalize_std: divide by the group's standard deviation.
        eps: added to the std in the denominator (> 0).
    Returns:
        float [B, R]: A_i on every generated token of row i, 0 on padding.
    """
    B = rewards.shape[0]
    if rewards.dim() != 1 or group_ids.shape != (B,) or response_mask.shape[:1] != (B,):
        raise ValueError(
            f"rewards [B], group_ids [B] and response_mask [B, R] must share B; got "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}, {tuple(response_mask.shape)}"
        )
    if group_ids.dtype.is_floating_point:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    r = rewards.detach().double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    G = int(inverse.max()) + 1 if B > 0 else 0
    count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count  # mean_g
    centered = r - mean[inverse]  # r_i − mean_g
    r_max = torch.full_like(count, -torch.inf).scatter_reduce(0, inverse, r, "amax")
    r_min = torch.full_like(count, torch.inf).scatter_reduce(0, inverse, r, "amin")
    constant = (r_max == r_min)[inverse]  # std_g = 0 exactly
    if normalize_std:
        # std_g = sqrt(Σ (r − mean_g)² / (n_g − 1)), n_g − 1 floored at 1
        sq = torch.zeros_like(count).index_add_(0, inverse, centered**2)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std[inverse] + eps)
    else:
        adv = centered
    adv = torch.where(constant, torch.zeros_like(adv), adv).to(rewards.dtype)
    return torch.where(response_mask > 0, adv[:, None], 0.0)
