import pytest
import torch

from minippo.rl.functional import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def test_masked_stats_by_hand():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert masked_sum(x, m).item() == 1.0 + 2.0 + 4.0 + 0.0
    assert masked_mean(x, m).item() == pytest.approx(7.0 / 4)
    mean = 7.0 / 4
    var = sum((v - mean) ** 2 for v in (1.0, 2.0, 4.0, 0.0))
    assert masked_var(x, m).item() == pytest.approx(var / 3)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(var / 4)
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 2.0]))


def test_masked_stats_empty_and_single():
    x = torch.tensor([[3.0, 1.0]])
    assert masked_mean(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_var(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_var(x, torch.tensor([[1.0, 0.0]])).item() == 0.0
    assert torch.equal(masked_whiten(x, torch.zeros(1, 2)), torch.zeros(1, 2))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    w = masked_whiten(x, m, eps=0.0)
    # mean 2, unbiased var 1
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64))
    w_keep = masked_whiten(x, m, shift_mean=False, eps=0.0)
    torch.testing.assert_close(w_keep, torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=torch.float64))
