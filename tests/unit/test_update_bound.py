"""``ppo.max_update_kl`` (minippo.training.update_bound): a step within the bound is kept; one beyond
it is shortened to θ_before + α·(θ_stepped − θ_before) for the first α = 1/2, 1/4, ... within the
bound, keeping the step's optimizer state; one that no α brings within it (or a NaN KL) is undone,
the weights and the optimizer state as before it, bit for bit, so training goes on as if it had
not been taken. The KL is the token mean of k3 over the response tokens of all micro-batches and
ranks, and every rank takes the same decision."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minippo.training.update_bound import UpdateBound
from tests.helpers import run_on_ranks, shared_process_group


def _model_and_adam(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))


def _step(model, opt, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _opt_state(opt) -> list[torch.Tensor]:
    return [torch.as_tensor(v).clone() for st in opt.state.values() for _, v in sorted(st.items())]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _stepped(bound: UpdateBound):
    """A model and AdamW after one step, snapshot taken, then a second step: (model, opt,
    params and optimizer state before / after the second step)."""
    model, opt = _model_and_adam()
    _step(model, opt, seed=1)
    before = (_params(model), _opt_state(opt))
    bound.snapshot(model, opt)
    _step(model, opt, seed=2)
    after = (_params(model), _opt_state(opt))
    assert not _equal(before[0], after[0]) and not _equal(before[1], after[1])
    return model, opt, before, after


def test_an_undone_step_leaves_weights_and_adam_state_bit_identical_and_training_goes_on():
    bound = UpdateBound(0.05)
    model, opt, before, _ = _stepped(bound)
    kept, kl = bound.settle(lambda: torch.tensor(1.0), model, opt, step=0)  # never within
    assert not kept and kl == 1.0 and bound.take_counts() == (0, 1)
    assert _equal(_params(model), before[0]) and _equal(_opt_state(opt), before[1])
    ref_model, ref_opt = _model_and_adam()  # a run that never took the undone step
    _step(ref_model, ref_opt, seed=1)
    _step(model, opt, seed=3)
    _step(ref_model, ref_opt, seed=3)
    assert _equal(_params(model), _params(ref_model))
    assert _equal(_opt_state(opt), _opt_state(ref_opt))


def test_a_step_within_the_bound_is_kept_as_taken():
    bound = UpdateBound(0.05)
    model, opt, _, after = _stepped(bound)
    kept, kl = bound.settle(lambda: torch.tensor(0.049), model, opt, step=0)
    assert kept and kl == float(torch.tensor(0.049)) and bound.take_counts() == (0, 0)
    assert _equal(_params(model), after[0]) and _equal(_opt_state(opt), after[1])


def test_a_step_beyond_the_bound_is_halved_until_within_it_and_keeps_its_optimizer_state():
    bound = UpdateBound(0.05)
    model, opt, before, after = _stepped(bound)
    alphas = []

    def measure() -> torch.Tensor:  # KL ∝ α²: 0.7 for the full step, within 0.05 at α = 1/4
        now, old, new = _params(model)[0], before[0][0], after[0][0]
        alpha = float(((now - old).norm() / (new - old).norm()).item())
        alphas.append(alpha)
        return torch.tensor(0.7 * alpha**2)

    kept, kl = bound.settle(measure, model, opt, step=0)
    assert kept and kl == float(torch.tensor(0.7)) and bound.take_counts() == (1, 0)
    assert [round(a, 5) for a in alphas] == [1.0, 0.5, 0.25]
    want = [a.lerp(b, 0.25) for a, b in zip(before[0], after[0], strict=True)]
    assert _equal(_params(model), want)  # θ_before + ¼·(θ_stepped − θ_before), as rounded by lerp
    assert _equal(_opt_state(opt), after[1])


def test_a_nan_kl_undoes_the_step():
    bound = UpdateBound(0.05)
    model, opt, before, _ = _stepped(bound)
    kept, kl = bound.settle(lambda: torch.tensor(math.nan), model, opt, step=0)
    assert not kept and math.isnan(kl) and bound.take_counts() == (0, 1)
    assert _equal(_params(model), before[0]) and _equal(_opt_state(opt), before[1])


def test_the_kl_is_the_token_mean_of_k3_over_the_response_tokens_of_all_micro_batches():
    g = torch.Generator().manual_seed(0)
    before = [torch.randn(3, 5, generator=g) - 2 for _ in range(2)]
    after = [b + 0.3 * torch.randn(3, 5, generator=g) for b in before]
    masks = [(torch.rand(3, 5, generator=g) > 0.3).float() for _ in range(2)]
    tokens = sum(m.sum() for m in masks)
    shares = [UpdateBound.kl(b, a, m, tokens) for b, a, m in zip(before, after, masks, strict=True)]
    d = torch.cat([(a - b)[m > 0] for b, a, m in zip(before, after, masks, strict=True)]).double()
    want = (d.exp() - 1 - d).mean()  # k3 of KL(before ‖ after) on the tokens, in float64
    # float32: each k3 term and the sums of ~20 terms of size ~0.05 round at 2^-24 relative; the
    # expm1(d) − d difference loses log2(|expm1(d)| / k3) ≈ 4 bits: a few 1e-7 in all
    torch.testing.assert_close(sum(shares).double(), want, rtol=1e-6, atol=0)


def _settle_on_two_ranks(rank: int, world_size: int) -> None:
    bound = UpdateBound(0.05)
    model, opt, before, _ = _stepped(bound)
    # rank 0's share alone is within the bound; the sum over ranks is not, and stays beyond it
    # however far the step is shortened: both ranks undo
    kept, kl = bound.settle(lambda: torch.tensor([0.03, 0.04][rank]), model, opt, step=0)
    assert not kept and abs(kl - 0.07) < 1e-7, (rank, kl)
    assert _equal(_params(model), before[0]) and _equal(_opt_state(opt), before[1])
    flags = [None] * world_size
    dist.all_gather_object(flags, kept)
    assert flags == [False, False]


def _two_ranks(rank: int, world_size: int) -> None:
    with shared_process_group():
        _settle_on_two_ranks(rank, world_size)


def test_all_ranks_sum_their_shares_and_take_the_same_decision():
    run_on_ranks(_two_ranks, world_size=2)
