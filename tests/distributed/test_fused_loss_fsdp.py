"""The recipe's policy loss (the lm_head and the loss in one pass, ``models.fused_policy_loss``)
trains the same step as the unfused reference (``tests.helpers.reference_actor_backward``:
``token_logprobs_and_entropy`` then ``rl.policy_loss``), on 1 process and on 2 FSDP2-sharded
gloo ranks (the fused pass runs inside the sharded model's forward, where FSDP2 has gathered the
lm_head, and its gradient goes through the same reduce-scatter).

Each case runs one recipe step on the 8 fixed rollouts of tests.helpers twice, as shipped and
with the reference micro-step, from the same weights; the SGD updates must agree. Cases: GAE +
critic with the default EWMA correction and gradient clipping active; critic-free GRPO with the
KL in the loss (k3), TIS weights and seq-mean-token-mean (one update per step: the anchor is the
training forward's own logprob, formed chunk by chunk inside the fused pass); loglinear_prox (an anchor that follows the
current policy, also formed inside the pass) with the dual clip and seq-mean-token-sum; TIS at
sequence level in mask mode (weights that need whole rows: the fused path's extra no-grad forward).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minippo.config import load_config
from tests.distributed.test_one_vs_two_ranks import _copy, _live_weights
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
    use_reference_policy_loss,
)

U = torch.finfo(torch.float32).eps / 2  # unit roundoff 2⁻²⁴
CASES = {
    "gae_clipped": ["kl.coef=0.05"],
    "grpo_kl_loss": [
        "advantage_estimator=grpo",
        "kl.coef=0.05",
        "kl.mode=loss",
        "kl.estimator=k3",
        "correction._component_=minippo.rl.correction.TIS",
        "~correction.reset_below",
        "ppo.loss_agg_mode=seq-mean-token-mean",
        "ppo.max_grad_norm=1e9",
    ],
    "loglinear_prox_dual_clip": [
        "advantage_estimator=grpo",
        "correction._component_=minippo.rl.correction.LogLinearProx",
        "~correction.reset_below",
        "ppo.dual_clip=1.5",
        "ppo.loss_agg_mode=seq-mean-token-sum",
        "ppo.max_grad_norm=1e9",
    ],
    "tis_sequence_mask": [
        "advantage_estimator=grpo",
        "correction._component_=minippo.rl.correction.TIS",
        "~correction.reset_below",
        "+correction.level=geometric",
        "+correction.mode=mask",
        "+correction.low=0.5",
        "ppo.max_grad_norm=1e9",
    ],
}


def _step(out: Path, name: str, fused: bool, rank: int, world: int) -> dict | None:
    from minippo.parallel import gather_full_state_dict
    from minippo.training.metrics import read_jsonl

    run = out / f"{name}-{world}-{'fused' if fused else 'unfused'}"
    overrides = [*FIXED_BATCH_OVERRIDES, f"output_dir={run}", *CASES[name]]
    cfg = load_config("tiny_cpu", overrides)
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        if not fused:
            use_reference_policy_loss(recipe)
        _live_weights(recipe, cfg.seed)
        before = _copy(gather_full_state_dict(recipe.actor))
        recipe.train()
        after = _copy(gather_full_state_dict(recipe.actor))
    if rank != 0:
        return None
    (row,) = read_jsonl(run / "metrics.jsonl")
    return {"before": before, "after": after, "metrics": row}


def _all(out: Path, rank: int, world: int) -> dict:
    return {(n, f): _step(out, n, f, rank, world) for n in CASES for f in (False, True)}


def _two_ranks(rank: int, world: int, out: str) -> None:
    from tests.helpers import shared_process_group

    with shared_process_group():
        results = _all(Path(out), rank, world)
        if rank == 0:
            torch.save(results, Path(out) / "two_ranks.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    from tests.helpers import run_on_ranks

    out = tmp_path_factory.mktemp("fused_fsdp")
    threads = torch.get_num_threads()
    try:
        one = _all(out, 0, 1)
    finally:
        torch.set_num_threads(threads)
    run_on_ranks(_two_ranks, str(out))
    return {1: one, 2: torch.load(out / "two_ranks.pt", weights_only=False)}


# Tolerance: the fused gradient of the logits differs from autograd's by float32 rounding, at most
# 4u·|dz| per entry (tests/unit/test_fused_policy_loss.py), and a weight's gradient sums at most
# V = 64 such terms per logit row: ≤ 4V·u·G. On top, each side's own float32 backward sums over the
# N = 8·11 positions (≤ 2N·u·G, as in test_one_vs_two_ranks.py) and clipping's factor moves by the
# norm's relative error. The SGD updates lr·c·g then differ by ≤ (4V + 4N + 4)·u·M per tensor
# (M = max|update|), plus one rounding of each new weight.
V, N = 64, 8 * 11


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_step_equals_unfused_step(runs, name, world):
    a, b = runs[world][(name, False)], runs[world][(name, True)]
    worst, moved = 0.0, 0.0
    for k, w0 in a["before"].items():
        assert torch.equal(w0, b["before"][k]), k
        upd = a["after"][k] - w0
        bound = (4 * V + 4 * N + 4) * U * upd.abs().max() + U * (
            a["after"][k].abs() + b["after"][k].abs()
        )
        diff = (a["after"][k] - b["after"][k]).abs()
        worst = max(worst, float((diff / bound.clamp(min=1e-30)).max()))
        moved = max(moved, float(upd.abs().max()))
    assert worst <= 1.0, f"fused vs unfused update: {worst:.3g} x the bound"
    assert moved > 1e-4  # the step moved the weights: the comparison is not empty
    ma, mb = a["metrics"], b["metrics"]
    for key, value in ma.items():
        summed = "grad_norm" in key or key.endswith("loss")
        if key.startswith("train/") and summed and isinstance(value, float) and key in mb:
            tol = (4 * V + 4 * N) * U
            assert mb[key] == pytest.approx(value, rel=tol, abs=tol), key
    assert ("train/kl_loss" in mb) == ("kl.mode=loss" in CASES[name])
    assert "train/entropy" in mb and "train/clip_frac_high" in mb
