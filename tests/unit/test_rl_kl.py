import math

import pytest
import torch

from minippo.rl.kl import kl_estimate, kl_loss, kl_penalty


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    d0, d1 = -1.5 - -1.0, -1.0 - -2.0  # d = ref − logp
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([[-d0, -d1]]))
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k2"), torch.tensor([[0.5 * d0**2, 0.5 * d1**2]])
    )
    k3 = [math.exp(d) - 1 - d for d in (d0, d1)]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([k3]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_unbiased_on_a_categorical():
    # E_{x~p}[k1] = E_{x~p}[k3] = KL(p ‖ q) exactly, by summing over the support
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        est = kl_estimate(p.log()[None], q.log()[None], kind)[0]
        assert float((p * est).sum()) == pytest.approx(kl)


def test_kl_clamped_and_finite():
    out = kl_estimate(torch.tensor([[0.0]]), torch.tensor([[1000.0]]), "k3")
    assert out.item() == pytest.approx(math.exp(20.0) - 1 - 20.0, rel=1e-5)


def test_kl_penalty_masked_and_no_grad():
    logp = torch.tensor([[-1.0, -2.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    pen = kl_penalty(logp, ref, mask, "k1")
    assert not pen.requires_grad
    torch.testing.assert_close(pen, torch.tensor([[-1.0 + 1.5, -2.0 + 1.0, 0.0]]))


def test_kl_loss_grad_and_aggregation():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, stats = kl_loss(logp, ref, mask, "k3")
    d = [-0.5, 1.0, 0.0]
    expected = sum(math.exp(x) - 1 - x for x in d) / 3
    assert float(loss.detach()) == pytest.approx(expected)
    assert float(stats.kl_loss) == pytest.approx(expected)
    # d k3 / d logp = −(exp(d) − 1) = 1 − exp(d)
    (grad,) = torch.autograd.grad(loss, logp)
    expected_grad = torch.tensor(
        [[(1 - math.exp(-0.5)) / 3, (1 - math.exp(1.0)) / 3], [0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(grad, expected_grad)
    assert torch.autograd.gradcheck(lambda lp: kl_loss(lp, ref, mask, "k2")[0], (logp,))
