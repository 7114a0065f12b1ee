"""The non-finite guard on 2 gloo ranks: a NaN/inf on one rank makes every rank skip the same
optimizer step (sharded weights must take the same steps everywhere), and every rank stops the
run at the same step."""

import math

import pytest
import torch

from minippo.parallel import destroy_distributed, init_distributed
from minippo.training.nan_guard import NonFiniteError, NonFiniteGuard, all_finite


def _check(rank, world):
    init_distributed()
    try:
        bad = float("nan") if rank == 1 else 1.0
        assert all_finite(torch.tensor(1.0), torch.tensor(2.0))
        assert not all_finite(torch.tensor(bad), torch.tensor(2.0))  # NaN loss on rank 1 only
        assert not all_finite(1.0, math.inf if rank == 0 else 1.0)  # inf norm on rank 0 only
        guard = NonFiniteGuard(max_consecutive=2)
        steps = [
            guard.check(torch.tensor(1.0), torch.tensor(1.0), step=0),
            guard.check(torch.tensor(bad), torch.tensor(1.0), step=1),  # skipped on both
            guard.check(torch.tensor(1.0), torch.tensor(1.0), step=2),
            guard.check(torch.tensor(1.0), torch.tensor(bad), step=3),  # skipped on both
        ]
        assert steps == [True, False, True, False], (rank, steps)
        assert guard.state_dict() == {"skipped_total": 2, "consecutive": 1}
        with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
            guard.check(torch.tensor(bad), torch.tensor(1.0), step=4)  # both ranks stop here
    finally:
        destroy_distributed()


def test_a_non_finite_value_on_one_rank_skips_the_step_on_every_rank(run_on_ranks):
    run_on_ranks(_check)
