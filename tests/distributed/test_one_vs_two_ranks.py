"""One training step of the recipe on 2 ranks equals the same step on 1 rank (the production path:
FSDP2 on N ranks, each rank a share of the rollouts).

Both runs train ``AsyncPPORecipe`` one step on the same 8 fixed rollouts (tests.helpers: the queue
hands rank r rows 4r..4r+3 on 2 ranks, all 8 on 1); the single process trains unsharded, the 2
ranks FSDP2-sharded with summed gradients. Everything the step computes goes through the recipe:
reference logprobs, critic values, the correction's anchors and weights, advantages (whitened over
all ranks), the losses with global token/sequence counts, gradient clipping, the optimizer step.
Cases: GAE with a critic and the KL penalty in the reward, critic-free GRPO with the KL in the
loss, gradient clipping active; together every loss aggregation mode.

The optimizer is SGD (θ₁ = θ₀ − lr·c·g, c the clipping factor): the update is proportional to the
gradient, so a wrong gradient scale (e.g. FSDP's mean instead of the sum of the ranks' shares,
which halves the gradients on 2 ranks) changes it by that factor. AdamW's first step,
g / (|g| + eps), would hide any scale; its arithmetic is elementwise and so the same sharded or not.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from minippo.config import load_config
from tests.helpers import FIXED_BATCH_OVERRIDES, fixed_rollout_batch, recipe_on_fixed_batches

U = torch.finfo(torch.float32).eps / 2  # unit roundoff 2⁻²⁴
CASES = {
    # GAE + critic + KL penalty in the reward (k1 under μ), token-mean, EWMA, no clipping
    "gae_kl_reward_token_mean": ["kl.coef=0.05", "ppo.max_grad_norm=1e9"],
    # clipping active (the shipped max_grad_norm 1.0; the norms are above 3): update lr·g/‖g‖
    "gae_seq_mean_token_sum_clipped": ["ppo.loss_agg_mode=seq-mean-token-sum"],
    # critic-free GRPO, KL in the loss (k3), TIS weights
    "grpo_kl_loss_seq_mean_token_mean": [
        "advantage_estimator=grpo",
        "kl.coef=0.05",
        "kl.mode=loss",
        "kl.estimator=k3",
        "correction._component_=minippo.rl.correction.TIS",
        "~correction.reset_below",
        "ppo.loss_agg_mode=seq-mean-token-mean",
        "ppo.max_grad_norm=1e9",
    ],
}
SUMMED = ("train/loss", "train/policy_loss", "train/kl_loss", "train/value_loss")
NORMS = ("train/grad_norm", "train/critic_grad_norm")


def _critic_head(critic_args, seed: int) -> dict:
    """The critic's seeded init with a non-zero value head: the zero head of ``init_weights``
    passes no gradient to the body in the first step, which would leave the body untested."""
    from minippo.models import ValueModel, init_weights

    sd = init_weights(ValueModel(critic_args), seed=seed).state_dict()
    g = torch.Generator().manual_seed(123)
    sd["value_head.weight"] = 0.3 * torch.randn(sd["value_head.weight"].shape, generator=g)
    return sd


def _moved_reference(args, seed: int) -> dict:
    """The actor's seeded init plus seeded noise: a reference that differs from the actor, so
    that the KL term has a gradient in the first step (at π = π_ref, k3's gradient is 0)."""
    from minippo.models import Transformer, init_weights

    sd = init_weights(Transformer(args), seed=seed).state_dict()
    g = torch.Generator().manual_seed(321)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def _live_weights(recipe, seed: int) -> dict:
    """Load the moved reference and the critic with a live head into a set-up recipe (seed: the
    config's); returns the models the step trains, by name."""
    from minippo.parallel import load_full_state_dict

    models = {"actor": recipe.actor}
    if recipe.ref is not None:
        load_full_state_dict(recipe.ref, _moved_reference(recipe.actor.args, seed), device="cpu")
    if recipe.critic is not None:
        load_full_state_dict(
            recipe.critic, _critic_head(recipe.critic.args, seed + 1), device="cpu"
        )
        models["critic"] = recipe.critic
    return models


def train_one_step(out: Path, name: str, rank: int, world: int) -> dict | None:
    """One recipe step of case ``name``; returns (on rank 0) the full weights before and after,
    and the logged metrics."""
    from minippo.parallel import gather_full_state_dict
    from minippo.training.metrics import read_jsonl

    run = out / f"{name}-{world}"
    cfg = load_config("tiny_cpu", [*FIXED_BATCH_OVERRIDES, f"output_dir={run}", *CASES[name]])
    result = {}
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        models = _live_weights(recipe, cfg.seed)
        # copies (unsharded, the gathered dict holds the parameters themselves)
        before = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
        recipe.train()
        after = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
        result = {"before": before, "after": after}
    if rank != 0:
        return None
    (row,) = read_jsonl(run / "metrics.jsonl")
    return {**result, "metrics": row}


def _copy(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def _two_ranks(rank: int, world: int, out: str) -> None:
    from tests.helpers import shared_process_group

    with shared_process_group():  # the cases in turn
        results = {name: train_one_step(Path(out), name, rank, world) for name in CASES}
        if rank == 0:
            torch.save(results, Path(out) / "two_ranks.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every case on 1 rank (this process, no process group) and on 2 gloo ranks."""
    from tests.helpers import run_on_ranks

    out = tmp_path_factory.mktemp("one_vs_two")
    threads = torch.get_num_threads()
    try:
        one = {name: train_one_step(out, name, 0, 1) for name in CASES}
    finally:
        torch.set_num_threads(threads)  # the recipe sets cpu_threads
    run_on_ranks(_two_ranks, str(out))
    two = torch.load(out / "two_ranks.pt", weights_only=False)
    return {name: (one[name], two[name]) for name in CASES}


# Tolerance. A gradient entry is a float32 sum over the N = B·S = 8·11 positions of the batch;
# the two runs add the same per-position terms in another order (other micro-batches, then the
# ranks' reduce-scatter), and a sum of N terms whose partial sums stay within the gradient scale
# G = max|g| of its tensor rounds by at most (N − 1)·u·G: together ≤ 2N·u·G (the per-row forward
# has the same shapes on both sides: micro-batches and scoring chunks of 4 rows). With clipping,
# c = max_norm / ‖g‖ moves by the norm's relative error, ≤ 2N·u + 4u. So the updates lr·c·g differ
# by ≤ (4N + 4)·u·M per tensor, M = max|update| of that tensor; each side then rounds the new
# weight θ₀ − update once (≤ u·|θ₁| each). Observed: ≤ 20·u·M. A gradient off by a factor (½
# on 2 ranks) moves the update by M/2, ~10⁴ times the bound.
N = 8 * 11


def _max_excess(before: dict, a: dict, b: dict) -> tuple[float, str]:
    """max over tensors of |Δa − Δb| / bound (≤ 1 passes), and the worst tensor's name."""
    worst, worst_name = 0.0, ""
    for k in before:
        upd = a[k] - before[k]
        bound = (4 * N + 4) * U * upd.abs().max() + U * (a[k].abs() + b[k].abs())
        ratio = float(((a[k] - b[k]).abs() / bound.clamp(min=1e-30)).max())
        if ratio > worst:
            worst, worst_name = ratio, k
    return worst, worst_name


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_step_equals_one_rank_step(runs, name):
    one, two = runs[name]
    for model in one["after"]:
        before = one["before"][model]
        for k in before:  # both start from the same weights
            assert torch.equal(before[k], two["before"][model][k]), (model, k)
        excess, tensor = _max_excess(before, one["after"][model], two["after"][model])
        assert excess <= 1.0, f"{model}.{tensor}: difference {excess:.3g} x the bound"
        moved = max(float((one["after"][model][k] - before[k]).abs().max()) for k in before)
        assert moved > 1e-4, f"{model} barely moved ({moved}): the comparison would be empty"
    # the logged losses (the ranks' shares summed) and gradient norms agree as well; per-token
    # terms are O(1) (whitened advantages x ratios near 1, value errors of rewards in [0, 1])
    m1, m2 = one["metrics"], two["metrics"]
    for key in (*SUMMED, *NORMS):
        if key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=4 * N * U, abs=4 * N * U * 3), key
    assert ("train/kl_loss" in m1) == ("kl.mode=loss" in CASES[name])
    assert m1.get("train/kl_loss", 1.0) > 0  # the KL term is live
    assert ("train/value_loss" in m1) == ("advantage_estimator=grpo" not in CASES[name])
    assert not any(math.isnan(v) for k, v in m1.items() if k in SUMMED)
