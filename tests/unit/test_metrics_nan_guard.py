"""The non-finite guard: skipped steps leave weights and optimizer state untouched."""

import math

import pytest
import torch
from torch import nn

from minippo.training.nan_guard import NonFiniteError, NonFiniteGuard, all_finite, clip_and_step


def _step(model, optim, guard, x, step, *, poison=False):
    """One optimizer step the recipe's way (``clip_and_step``); True when the optimizer stepped."""
    loss = model(x).pow(2).mean()
    if poison:
        loss = loss * float("nan")
    loss.backward()
    norm, took = clip_and_step(model, optim, guard, loss, max_norm=1.0, step=step)
    assert math.isfinite(float(norm)) != poison  # the norm before clipping, NaN when poisoned
    return took


def test_nan_step_is_skipped_and_weights_stay_clean():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(max_consecutive=3)
    x = torch.randn(4, 3)
    assert _step(model, optim, guard, x, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optim.state[model.weight]["exp_avg"].clone()
    assert not _step(model, optim, guard, x, 1, poison=True)
    assert guard.consecutive == 1 and guard.skipped_total == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert torch.equal(optim.state[model.weight]["exp_avg"], moments)
    assert all(p.grad is None for p in model.parameters())
    # a finite step afterwards trains normally and resets the run of skips
    assert _step(model, optim, guard, x, 2)
    assert guard.consecutive == 0 and guard.skipped_total == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_repeated_nans_stop_the_run_with_clear_error():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(max_consecutive=2)
    x = torch.randn(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not _step(model, optim, guard, x, 5, poison=True)
    with pytest.raises(
        NonFiniteError, match=r"step 6: 2 optimizer steps in a row.*max_consecutive_nonfinite"
    ):
        _step(model, optim, guard, x, 6, poison=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_all_finite_and_state_and_validation():
    assert all_finite(torch.tensor(1.0), 2.0)
    assert not all_finite(torch.tensor(1.0), math.inf)
    assert not all_finite(torch.tensor([1.0, float("nan")]))
    g = NonFiniteGuard(4)
    g.load_state_dict({"skipped_total": 3, "consecutive": 1})
    assert g.state_dict() == {"skipped_total": 3, "consecutive": 1}
    with pytest.raises(
        ValueError, match="max_consecutive_nonfinite must be an integer >= 1, got 0"
    ):
        NonFiniteGuard(0)
