"""Pure RL math on response-aligned ``[B, R]`` tensors: advantages, losses, KL, aggregation.

The behaviour-policy corrections live in ``minippo.rl.correction`` (import it by that name) and
the batch container in ``minippo.rl.types``.
"""

from minippo.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae,
    group_advantages,
    last_token_index,
    needs_critic,
    place_sequence_rewards,
    split_critic_values,
)
from minippo.rl.aggregation import AGGREGATION_MODES, GlobalCounts, aggregate, global_counts
from minippo.rl.functional import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from minippo.rl.kl import KL_ESTIMATORS, KLStats, kl_estimate, kl_loss, kl_penalty
from minippo.rl.losses import (
    LOG_RATIO_CLAMP,
    PolicyStats,
    ValueStats,
    as_metrics,
    explained_variance,
    near_zero_fraction,
    policy_loss,
    value_loss,
)
from minippo.rl.types import RolloutBatch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "GlobalCounts",
    "KLStats",
    "PolicyStats",
    "RolloutBatch",
    "ValueStats",
    "aggregate",
    "as_metrics",
    "explained_variance",
    "gae",
    "global_counts",
    "group_advantages",
    "kl_estimate",
    "kl_loss",
    "kl_penalty",
    "last_token_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "near_zero_fraction",
    "needs_critic",
    "place_sequence_rewards",
    "policy_loss",
    "split_critic_values",
    "value_loss",
]
