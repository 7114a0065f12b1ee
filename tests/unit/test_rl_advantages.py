import pytest
import torch

from minippo.rl.advantages import (
    gae,
    group_advantages,
    last_token_index,
    place_sequence_rewards,
    split_critic_values,
)


def reference_gae(values, rewards, mask, gamma, lam, final_values):
    """Plain Python loop over each row's generated tokens, in order, skipping padding."""
    B, R = values.shape
    adv = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        steps = [t for t in range(R) if mask[b, t] > 0]
        running = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_v = values[b, steps[i + 1]].item() if i + 1 < len(steps) else final_values[b]
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
    returns = (adv + values.double()) * (mask > 0)
    return adv, returns


def test_gae_tiny_by_hand():
    # one row, two tokens, finished; γ = 0.9, λ = 0.8
    values = torch.tensor([[0.5, 0.2]])
    rewards = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    delta1 = 1.0 + 0.9 * 0.0 - 0.2
    delta0 = 0.0 + 0.9 * 0.2 - 0.5
    a1 = delta1
    a0 = delta0 + 0.9 * 0.8 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2]]))


def test_gae_value_lam_decouples_the_critic_targets():
    # γ = 1: advantages with λ = 0.5, returns with value_lam = 1 (the reward to go, Monte Carlo),
    # across a masked position and a truncated row bootstrapped from the critic
    values = torch.tensor([[0.5, 9.0, 0.2], [0.3, 0.4, 0.6]])
    rewards = torch.tensor([[0.1, 7.0, 1.0], [0.0, 0.0, 0.5]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    truncated, boot = torch.tensor([False, True]), torch.tensor([0.0, 0.25])
    kw = dict(gamma=1.0, truncated=truncated, bootstrap_values=boot)
    adv, ret = gae(values, rewards, mask, lam=0.5, value_lam=1.0, **kw)
    adv_half, _ = gae(values, rewards, mask, lam=0.5, **kw)
    _, ret_mc = gae(values, rewards, mask, lam=1.0, **kw)
    torch.testing.assert_close(adv, adv_half)  # the policy's advantages keep lam
    torch.testing.assert_close(ret, ret_mc)  # the critic's targets are value_lam's
    # by hand: the reward to go (+ the bootstrap of the truncated row), 0 on the masked position
    torch.testing.assert_close(ret, torch.tensor([[1.1, 0.0, 1.0], [0.75, 0.75, 0.75]]))
    # value_lam None or equal to lam: the coupled estimate, bit for bit
    for same in (None, 0.5):
        a, r = gae(values, rewards, mask, lam=0.5, value_lam=same, **kw)
        assert torch.equal(a, adv_half) and torch.equal(
            r, gae(values, rewards, mask, lam=0.5, **kw)[1]
        )
    with pytest.raises(ValueError, match="value_lam"):
        gae(values, rewards, mask, lam=0.5, value_lam=1.5)


def test_gae_interior_mask_is_not_a_transition():
    # token 1 is masked: token 0's next value is token 2's value, and its advantage is
    # the one carried from token 2
    values = torch.tensor([[0.5, 9.0, 0.2]])
    rewards = torch.tensor([[0.1, 7.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.2
    a0 = (0.1 + 0.9 * 0.2 - 0.5) + 0.9 * 0.8 * a2
    torch.testing.assert_close(adv, torch.tensor([[a0, 0.0, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.2]]))


def test_gae_truncated_bootstrap_by_hand():
    values = torch.tensor([[0.5, 0.2], [0.5, 0.2]])
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    mask = torch.ones(2, 2)
    truncated = torch.tensor([True, False])
    boot = torch.tensor([3.0, 100.0])  # row 1 finished: its bootstrap must be ignored
    adv, _ = gae(
        values, rewards, mask, gamma=0.9, lam=1.0, truncated=truncated, bootstrap_values=boot
    )
    a1 = 1.0 + 0.9 * 3.0 - 0.2
    a0 = (0.9 * 0.2 - 0.5) + 0.9 * a1
    torch.testing.assert_close(adv[0], torch.tensor([a0, a1]))
    torch.testing.assert_close(adv[1, 1], torch.tensor(1.0 - 0.2))
    # bootstrap_truncated=False: the truncated row is treated as finished
    adv_off, _ = gae(
        values,
        rewards,
        mask,
        gamma=0.9,
        lam=1.0,
        truncated=truncated,
        bootstrap_values=boot,
        bootstrap_truncated=False,
    )
    torch.testing.assert_close(adv_off[0], adv_off[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_reference_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, R = 6, 9
    values = torch.randn(B, R, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, R, generator=g) > 0.3).double()
    mask[0] = 0.0  # an all-masked row
    mask[1] = 0.0
    mask[1, 0] = 1.0  # a length-1 response
    truncated = torch.rand(B, generator=g) > 0.5
    truncated[2] = True
    boot = torch.randn(B, generator=g, dtype=torch.float64)
    gamma, lam = 0.97, 0.9
    adv, ret = gae(
        values,
        rewards,
        mask,
        gamma=gamma,
        lam=lam,
        truncated=truncated,
        bootstrap_values=boot,
    )
    final = [boot[b].item() if truncated[b] else 0.0 for b in range(B)]
    ref_adv, ref_ret = reference_gae(values, rewards, mask, gamma, lam, final)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.isfinite(adv).all() and (adv[0] == 0).all()


def test_gae_requires_bootstrap_values_for_truncated_rows():
    with pytest.raises(ValueError, match="bootstrap_values"):
        gae(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(2, 3),
            truncated=torch.tensor([True, False]),
        )
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_place_sequence_rewards_and_last_index():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert last_token_index(mask).tolist() == [1, -1, 2, 0]
    out = place_sequence_rewards(torch.tensor([0.5, 2.0, -1.0, 3.0]), mask)
    expected = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0], [3.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_split_critic_values():
    # P = 2, R = 3; row 0 has 2 response tokens, row 1 has 3
    critic = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0], [20.0, 21.0, 22.0, 23.0, 24.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    values, boot = split_critic_values(critic, mask)
    torch.testing.assert_close(values, torch.tensor([[11.0, 12.0, 13.0], [21.0, 22.0, 23.0]]))
    torch.testing.assert_close(boot, torch.tensor([13.0, 24.0]))


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 2.0])
    group_ids = torch.tensor([7, 7, 7, 3, 3, 9])
    mask = torch.tensor([[1.0, 1.0]] * 5 + [[1.0, 0.0]])
    mask[1, 1] = 0.0
    adv = group_advantages(rewards, group_ids, mask)
    mean = 1.0 / 3.0
    std = (((1 - mean) ** 2 + 2 * mean**2) / 2) ** 0.5
    a_hi = (1 - mean) / (std + 1e-6)
    a_lo = (0 - mean) / (std + 1e-6)
    expected = torch.tensor(
        [[a_hi, a_hi], [a_lo, 0.0], [a_lo, a_lo], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    )
    torch.testing.assert_close(adv, expected)
    # mean only (no std)
    adv_mean = group_advantages(rewards, group_ids, mask, normalize_std=False)
    torch.testing.assert_close(adv_mean[0, 0], torch.tensor(1.0 - mean))


def test_group_advantages_zero_std_groups_are_zero_not_nan():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1]), torch.ones(4, 3))
    assert torch.equal(adv, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(rewards, torch.zeros(4), torch.ones(4, 3))
