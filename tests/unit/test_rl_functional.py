import math

import pytest
import torch

from minippo.rl.functional import (
    chunked_entropy,
    entropy_from_logits,
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


def test_entropy_by_hand():
    # uniform over 4: ln 4; a point mass (with -inf logits): 0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -math.inf, -math.inf, -math.inf]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), 0.0]))
    # p = softmax([ln 1, ln 3] / 1) = (1/4, 3/4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(torch.tensor([0.0, math.log(3)])).item() == pytest.approx(h)
    # temperature 2: softmax([0, 2 ln 3] / 2) is the same distribution
    out = entropy_from_logits(torch.tensor([0.0, 2 * math.log(3)]), temperature=2.0)
    assert out.item() == pytest.approx(h)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=0.0)


def test_chunked_entropy_matches_full_values_and_grads():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    full = entropy_from_logits(hidden @ weight.t(), temperature=0.7)
    chunked = chunked_entropy(hidden, weight, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(chunked.double(), full.double(), rtol=1e-5, atol=1e-6)
    gf = torch.autograd.grad(full.sum(), (hidden, weight))
    gc = torch.autograd.grad(chunked.sum(), (hidden, weight))
    for a, b in zip(gc, gf):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_entropy(hidden, weight, temperature=0.7), chunked.detach()
        )
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_entropy(hidden, weight.t())
