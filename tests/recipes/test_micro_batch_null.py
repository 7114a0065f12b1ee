"""``ppo.micro_batch_size: null``: each minibatch in one forward on every rank count."""

from __future__ import annotations

import pytest
import torch

from minippo.config import load_config
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    fixed_rollout_batch,
    recipe_globals,
    recipe_on_fixed_batches,
)


def _trained(tmp_path, micro: str) -> dict[str, torch.Tensor]:
    overrides = [
        *FIXED_BATCH_OVERRIDES,
        f"output_dir={tmp_path / micro}",
        f"ppo.micro_batch_size={micro}",
    ]
    cfg = load_config("tiny_cpu", overrides)
    with recipe_on_fixed_batches(cfg, lambda step: batch) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        rows = batch.batch_size // cfg.ppo.minibatches
        recipe.train()
        weights = {k: v.detach().clone() for k, v in recipe.actor.state_dict().items()}
    return rows, weights


def test_null_trains_the_minibatch_in_one_forward(tmp_path):
    """null equals a micro-batch of the whole minibatch: the same forward on the same rows, so
    the same bits."""
    rows, one = _trained(tmp_path, "null")
    _, whole = _trained(tmp_path, str(rows))
    for k, v in one.items():
        assert torch.equal(v, whole[k]), k


@pytest.mark.parametrize("world", [1, 2, 4])
def test_null_passes_the_batch_checks_on_any_rank_count(world):
    validate = recipe_globals()["validate_config"]
    cfg = load_config("tiny_cpu", ["ppo.micro_batch_size=null"])
    validate(cfg, world_size=world, distributed=False)
    with pytest.raises(Exception, match="or null"):
        validate(load_config("tiny_cpu", ["ppo.micro_batch_size=7"]), world_size=world)
