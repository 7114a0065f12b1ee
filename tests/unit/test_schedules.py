"""The learning-rate schedule: linear warm-up then cosine decay, value by value."""

import math

import pytest
import torch

from minippo.training.schedules import warmup_cosine


def lrs(steps: int, base_lr: float = 2.0, **kw) -> list[float]:
    """The lr of training steps 0..steps-1 as the recipe sees them (one ``step()`` per step)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = warmup_cosine(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_the_floor():
    # warm-up over 2 steps: (s + 1) / 2; then p = (s − 2) / (6 − 2) and
    # factor = r + (1 − r)(1 + cos πp) / 2 with r = 0.1; held at r after total_steps
    r = 0.1
    cos_part = [(1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75, 1, 1)]
    want = [0.5, 1.0] + [r + (1 - r) * c for c in cos_part]
    got = lrs(8, warmup_steps=2, total_steps=6, min_lr_ratio=r)
    assert got == pytest.approx([2.0 * f for f in want], rel=1e-12)
    assert got[2] == 2.0 and got[4] == pytest.approx(2.0 * (r + (1 - r) / 2))  # the midpoint
    assert got[-1] == got[-2] == pytest.approx(2.0 * r)


def test_a_run_shorter_than_its_warmup_ends_inside_it(caplog):
    from minippo.training import schedules

    schedules._SHORT_RUNS_TOLD.discard(4)  # said once per process: another test may have
    with caplog.at_level("WARNING"):
        got = lrs(4, warmup_steps=10, total_steps=4, min_lr_ratio=0.1)
        assert lrs(4, warmup_steps=10, total_steps=4, min_lr_ratio=0.1) == got  # the critic's
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8])  # (s + 1) / 10 of lr 2.0, no decay
    assert caplog.text.count("ends inside the warm-up, at 4/10 of the peak lr") == 1


def test_constant_after_warmup_and_no_warmup():
    assert lrs(5, warmup_steps=4) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert lrs(3) == [2.0, 2.0, 2.0]
    # a decay without warm-up starts at the full lr
    assert lrs(3, total_steps=2, min_lr_ratio=0.0) == pytest.approx([2.0, 1.0, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
        (dict(min_lr_ratio=1.5), r"min_lr_ratio must be in \[0, 1\]"),
        (dict(min_lr_ratio=0.1), "set total_steps="),
    ],
)
def test_bad_schedules_name_the_key(kw, match):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=match):
        warmup_cosine(opt, **kw)
