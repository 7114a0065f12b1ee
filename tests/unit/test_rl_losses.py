import math

import pytest
import torch

from minippo.rl.losses import explained_variance, near_zero_fraction, policy_loss, value_loss


def test_policy_loss_by_hand_asymmetric_clip():
    # eps_low = 0.2, eps_high = 0.28
    ratios = [1.5, 0.5, 1.1, 0.7]
    adv = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    anchor = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([ratios]))
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(logp, anchor, adv, mask, eps_low=0.2, eps_high=0.28)
    # per token: max(-r·A, -clip(r, 0.8, 1.28)·A)
    l0 = max(-1.5 * 1.0, -1.28 * 1.0)
    l1 = max(-0.5 * -2.0, -0.8 * -2.0)
    l2 = max(-1.1 * 3.0, -1.1 * 3.0)
    l3 = max(-0.7 * 0.5, -0.8 * 0.5)
    torch.testing.assert_close(loss, torch.tensor((l0 + l1 + l2 + l3) / 4))
    assert float(stats.clip_frac_high) == pytest.approx(1 / 4)  # token 0
    assert float(stats.clip_frac_low) == pytest.approx(1 / 4)  # token 1
    assert float(stats.ratio_max) == pytest.approx(1.5)
    assert float(stats.ratio_mean) == pytest.approx(sum(ratios) / 4)
    k3 = sum(math.exp(-math.log(r)) - 1 + math.log(r) for r in ratios) / 4
    assert float(stats.approx_kl) == pytest.approx(k3, rel=1e-5)


def test_policy_loss_dual_clip():
    logp = torch.log(torch.tensor([[5.0, 5.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, torch.zeros(1, 2), adv, mask, dual_clip=3.0)
    # A < 0: max(5·1, 1.2·1) = 5, then min(5, 3·1) = 3;  A > 0: max(-5, -1.2) = -1.2
    torch.testing.assert_close(loss, torch.tensor((3.0 + -1.2) / 2))
    assert float(stats.dual_clip_frac) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, torch.zeros(1, 2), adv, mask, dual_clip=1.0)


def test_policy_loss_weights_and_keep_mask_keep_the_denominator():
    logp = torch.zeros(2, 3, requires_grad=True)
    anchor = torch.zeros(2, 3)
    anchor[0, 1] = float("-inf")  # a rejected token with a non-finite anchor must not leak
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    keep = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([[0.5, 9.0, 2.0], [1.0, 1.5, 7.0]])
    loss, stats = policy_loss(logp, anchor, adv, mask, weights=w, keep_mask=keep)
    # r = 1 everywhere: L = -A; kept numerator over m·k, denominator Σ m = 5
    expected = -(0.5 * 1.0 + 2.0 * 3.0 + 1.0 * 4.0 + 1.5 * 5.0) / 5
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 2] == 0
    torch.testing.assert_close(logp.grad[0, 0], torch.tensor(-0.5 * 1.0 / 5))
    assert float(stats.kept_frac) == pytest.approx(4 / 5)


def test_policy_loss_log_ratio_clamped():
    logp = torch.tensor([[0.0]])
    anchor = torch.tensor([[-1000.0]])
    loss, stats = policy_loss(logp, anchor, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert math.isfinite(float(loss))
    assert float(stats.ratio_max) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_policy_loss_edge_cases_finite():
    # all-masked row and a length-1 response
    logp = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    mask[1, 0] = 1.0
    mask[2] = 1.0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, stats = policy_loss(logp, torch.zeros(3, 4), torch.randn(3, 4), mask, agg_mode=mode)
        (grad,) = torch.autograd.grad(loss, logp)
        assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
        assert all(math.isfinite(float(v)) for v in stats)
    # everything masked: loss 0, stats 0
    loss, stats = policy_loss(logp, torch.zeros(3, 4), torch.randn(3, 4), torch.zeros(3, 4))
    assert float(loss.detach()) == 0.0 and float(stats.ratio_max) == 0.0


def test_policy_loss_rejects_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(x, x, x, x, eps_low=1.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="aggregation mode"):
        policy_loss(x, x, x, torch.ones(2, 3), agg_mode="sum")


def test_policy_loss_gradcheck():
    g = torch.Generator().manual_seed(0)
    anchor = torch.randn(3, 5, generator=g, dtype=torch.float64)
    # keep ratios away from the clip boundaries, where the loss is not differentiable
    offsets = torch.tensor([0.0, 0.05, 0.5, -0.5, -0.05], dtype=torch.float64)
    logp = (anchor + offsets).requires_grad_()
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[2, 3:] = 0
    w = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.5
    keep = torch.ones(3, 5, dtype=torch.float64)
    keep[0, 1] = 0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):

        def f(lp, mode=mode):
            return policy_loss(
                lp, anchor, adv, mask, weights=w, keep_mask=keep, dual_clip=3.0, agg_mode=mode
            )[0]

        assert torch.autograd.gradcheck(f, (logp,))


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.3, 2.0]])
    old = torch.tensor([[0.5, 0.4, 0.0]])
    returns = torch.tensor([[1.2, 0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
    # token 0: V_clip = 0.5 + 0.2 = 0.7; max((1.0-1.2)², (0.7-1.2)²)
    l0 = max((1.0 - 1.2) ** 2, (0.7 - 1.2) ** 2)
    # token 1: V_clip = 0.3 (inside the range); (0.3-0.1)²
    l1 = (0.3 - 0.1) ** 2
    torch.testing.assert_close(loss, torch.tensor(0.5 * (l0 + l1) / 2))
    assert float(stats.value_clip_frac) == pytest.approx(0.5)
    loss_nohalf, _ = value_loss(values, old, returns, mask, clip_range=None, coef=0.1, half=False)
    expected = 0.1 * ((1.0 - 1.2) ** 2 + (0.3 - 0.1) ** 2) / 2
    torch.testing.assert_close(loss_nohalf, torch.tensor(expected))
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(values, old, returns, mask, clip_range=0.0)


def test_value_loss_gradcheck():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(2, 4, generator=g, dtype=torch.float64)
    values = (old + torch.tensor([0.05, 0.5, -0.5, -0.05], dtype=torch.float64)).requires_grad_()
    returns = torch.randn(2, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)

    def f(v):
        return value_loss(v, old, returns, mask, clip_range=0.2, coef=0.7)[0]

    assert torch.autograd.gradcheck(f, (values,))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    values = torch.tensor([[1.5, 1.5, 3.5, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # over the first three tokens: Var[R] = 1, residuals (-0.5, 0.5, -0.5): mean -1/6
    res = [-0.5, 0.5, -0.5]
    m = sum(res) / 3
    var_res = sum((x - m) ** 2 for x in res) / 2
    assert explained_variance(values, returns, mask) == pytest.approx(1 - var_res / 1.0)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values, torch.ones(1, 4), mask))


def test_near_zero_fraction_counts_response_tokens_within_the_reward_scale():
    adv = torch.tensor([[0.0, 0.0009, -0.0011, 0.5], [-0.001, 2.0, 7.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([0.0, 1.0])  # range 1: |A| <= 1e-3 is "zero"
    # counted: 0.0, 0.0009, -0.001 of the 6 response tokens; padding (7.0, 0.0) never counts
    assert near_zero_fraction(adv, mask, rewards) == pytest.approx(3 / 6)
    # the tolerance follows the reward scale: rewards 10x larger, 10x the tolerance
    assert near_zero_fraction(adv, mask, rewards * 10) == pytest.approx(4 / 6)
    # equal rewards: only exact zeros count (GRPO gives every token of a constant group 0)
    assert near_zero_fraction(adv, mask, torch.ones(2)) == pytest.approx(1 / 6)
    assert math.isnan(near_zero_fraction(adv, torch.zeros(2, 4), rewards))


def test_nan_in_padding_never_reaches_loss_or_grad():
    from minippo.rl.kl import kl_loss

    nan = float("nan")
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    junk = torch.tensor([[0.1, 0.2, nan]])
    keep = torch.tensor([[1.0, 0.0, 1.0]])
    weights = torch.tensor([[1.0, nan, nan]])
    anchor = torch.tensor([[-0.4, nan, nan]])
    values = torch.tensor([[0.3, 0.4, 0.5]], requires_grad=True)
    losses = [
        policy_loss(logp, anchor, junk, mask, weights=weights, keep_mask=keep, dual_clip=2.0)[0],
        value_loss(values, junk, junk, mask)[0],
        kl_loss(logp, junk, mask)[0],
    ]
    for loss in losses:
        assert torch.isfinite(loss)
    grads = torch.autograd.grad(sum(losses), (logp, values))
    assert all(torch.isfinite(g).all() for g in grads)
