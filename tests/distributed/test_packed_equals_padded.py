"""Packed passes train like padded ones: one recipe step with ``ppo.pack: true`` (token-budget
micro-batches, on 1 process, 2 FSDP ranks and 2 HSDP ranks) gives the update of ``ppo.pack:
false`` (rows, 1 process), for every correction, GAE and GRPO, the KL in the reward and in the
loss, the recipe's fused policy loss and the unfused reference micro-step of tests.helpers, and
every loss aggregation mode.

Every case trains ``AsyncPPORecipe`` one step on the same 8 fixed rollouts (tests.helpers; on 2
ranks rank r gets rows 4r..4r+3) with SGD, so the update is proportional to the gradient
(tests/distributed/test_one_vs_two_ranks.py explains why). The packed runs split each minibatch
by a budget of 12 real tokens: the 8 rows (11, 7, 11, 6, 7, 11, 4, 11 tokens) take 7
micro-batches on 1 process; on 2 ranks rank 0 needs 4 and rank 1 only 3, so the ranks agree on 4
(one fewer forward on rank 1 and FSDP's collectives would not line up). The scoring passes
(reference, critic values, anchors) pack 24 tokens per forward.

Tolerance. The padded and the packed step compute the same arithmetic grouped differently: every
forward value within K·u of the other (K: the summed reduction lengths along a token's path,
tests/unit/test_packing.py::chain_length), a logprob within K·u·Z absolutely (Z the largest
logit), a ratio exp(lp − a) within 2K·u·Z relatively, and a gradient entry a float32 sum over the
N = 8·11 positions in another order (2N·u·G, G the gradient's scale; the ranks' reduce-scatter and
the micro-batches regroup it). So the updates lr·g differ by at most (4N + 4 + 4K·(1 + Z))·u·M
per tensor, M = max|update| of that tensor, and each side rounds θ₀ − update once (u·|θ₁|). A
pass that lets a sequence see another, or a wrong micro-batch share, moves the update by O(M).

bfloat16. The same comparison in bfloat16 would not be a test: with u = 2⁻⁸ the bound exceeds
the update itself. Each pass of this 2-layer model is within 2·(16·2 + 3)·u = 0.27 of its scale
(tests/unit/test_packing.py), so a logprob within 0.27·Z, a ratio within 0.66 relative (Z = 1.2
here), a gradient entry within 0.52·G: about 1.2·M in all, so nothing that moves the update by
O(M) could fail it. The dtype changes only the rounding of the model's passes, which
tests/unit/test_packing.py compares packed against padded in bfloat16 per pass (logits, logprobs,
entropies, values, gradients), where its bound is below what a leak or a wrong position moves;
what the recipe does around them (rows, layouts, shares, corrections, FSDP) is the same code in
every dtype and is compared here in float32.
"""

from __future__ import annotations

import os
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

U = torch.finfo(torch.float32).eps / 2
C = "correction._component_=minippo.rl.correction."
CASES = {
    "rollout_logprobs_gae_kl_reward_unfused": [
        C + "RolloutLogprobs", "~correction.cap", "~correction.reset_below",
        "kl.coef=0.05", "ppo.max_grad_norm=1e9",
    ],
    "tis_grpo_kl_loss_fused_seq_mean_token_mean": [
        C + "TIS", "~correction.reset_below", "advantage_estimator=grpo", "kl.coef=0.05",
        "kl.mode=loss", "kl.estimator=k3", "ppo.loss_agg_mode=seq-mean-token-mean",
        "ppo.max_grad_norm=1e9",
    ],
    "keep_old_actor_gae_fused_seq_mean_token_sum_clipped": [
        C + "KeepOldActor", "~correction.reset_below", "ppo.loss_agg_mode=seq-mean-token-sum",
    ],
    "ewma_gae_kl_loss_unfused": [
        "kl.coef=0.05", "kl.mode=loss", "kl.estimator=k2", "ppo.max_grad_norm=1e9",
    ],
    "loglinear_prox_grpo_fused_kl_reward": [
        C + "LogLinearProx", "~correction.reset_below", "advantage_estimator=grpo",
        "kl.coef=0.05", "ppo.max_grad_norm=1e9",
    ],
}  # fmt: skip
# these cases train the actor with the unfused reference micro-step (rl.policy_loss)
UNFUSED = {name for name in CASES if name.endswith("_unfused")}
PADDED = ["ppo.pack=false"]  # rows: micro-batches and scoring chunks of 4 (FIXED_BATCH_OVERRIDES)
PACKED = [
    "ppo.pack=true",
    "ppo.micro_batch_size=null",
    "ppo.max_tokens_per_micro_batch=12",
    "ppo.score_micro_batch_size=null",
    "ppo.score_max_tokens_per_micro_batch=24",
]
RUNS = {"padded": (PADDED, 1), "packed": (PACKED, 1), "packed_fsdp2": (PACKED, 2)}
RUNS["packed_hsdp2"] = ([*PACKED, "parallel.sharding=hsdp"], 2)


def train_one_step(out: Path, case: str, run: str, rank: int, world: int) -> dict | None:
    """One recipe step; on rank 0 the full weights before and after and the metrics; on every
    rank the micro-batches per minibatch it ran."""
    from minippo.parallel import gather_full_state_dict
    from minippo.training.metrics import read_jsonl

    extra, _ = RUNS[run]
    path = out / f"{case}-{run}"
    cfg = load_config(
        "tiny_cpu", [*FIXED_BATCH_OVERRIDES, f"output_dir={path}", *CASES[case], *extra]
    )
    forwards: list[int] = []
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        if case in UNFUSED:
            use_reference_policy_loss(recipe)
        models = _live_weights(recipe, cfg.seed)
        real_plan = recipe._update_plan

        def plan(*args):
            out = real_plan(*args)
            forwards.extend(len(micros) for micros in out)
            return out

        recipe._update_plan = plan
        before = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
        recipe.train()
        after = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
    if rank != 0:
        return {"forwards": forwards}
    (row,) = read_jsonl(path / "metrics.jsonl")
    return {"before": before, "after": after, "metrics": row, "forwards": forwards}


def _ranks(rank: int, world: int, out: str) -> None:
    from tests.helpers import shared_process_group

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # HSDP: each rank a "node" of one rank, mesh (2, 1)
    with shared_process_group():  # the cases in turn
        results = {
            (case, run): train_one_step(Path(out), case, run, rank, world)
            for case in CASES
            for run, (_, w) in RUNS.items()
            if w == world
        }
        torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.helpers import run_on_ranks

    out = tmp_path_factory.mktemp("packed")
    threads = torch.get_num_threads()
    try:
        results = {
            (case, run): train_one_step(out, case, run, 0, 1)
            for case in CASES
            for run, (_, w) in RUNS.items()
            if w == 1
        }
    finally:
        torch.set_num_threads(threads)  # the recipe sets cpu_threads
    run_on_ranks(_ranks, str(out))
    two = torch.load(out / "rank0.pt", weights_only=False)
    for key, other in torch.load(out / "rank1.pt", weights_only=False).items():
        two[key]["forwards_rank1"] = other["forwards"]
    return results | two


def _chain_and_logits() -> tuple[int, float]:
    """K for the fixed batch's 11 positions, and Z, the largest logit of the initial actor."""
    from minippo.models import Transformer, init_weights, qwen3_tiny
    from tests.unit.test_packing import chain_length

    args = qwen3_tiny(vocab_size=51)
    batch = fixed_rollout_batch(args)
    actor = init_weights(Transformer(args), seed=0)
    with torch.no_grad():
        z = actor(
            batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
    return chain_length(args, batch.input_ids.shape[1]), float(z.abs().max())


def _max_excess(before: dict, a: dict, b: dict, factor: float) -> tuple[float, str]:
    """max over tensors of |Δa − Δb| / bound (≤ 1 passes), and the worst tensor's name."""
    worst, worst_name = 0.0, ""
    for k in before:
        upd = a[k] - before[k]
        bound = factor * U * upd.abs().max() + U * (a[k].abs() + b[k].abs())
        ratio = float(((a[k] - b[k]).abs() / bound.clamp(min=1e-30)).max())
        if ratio > worst:
            worst, worst_name = ratio, k
    return worst, worst_name


@pytest.mark.parametrize("run", ["packed", "packed_fsdp2", "packed_hsdp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_step_equals_the_padded_step(runs, case, run):
    ref, got = runs[(case, "padded")], runs[(case, run)]
    K, Z = _chain_and_logits()
    N = 8 * 11
    factor = 4 * N + 4 + 4 * K * (1 + Z)
    for model in ref["after"]:
        before = ref["before"][model]
        for k in before:
            assert torch.equal(before[k], got["before"][model][k]), (model, k)
        excess, tensor = _max_excess(before, ref["after"][model], got["after"][model], factor)
        assert excess <= 1.0, f"{model}.{tensor}: difference {excess:.3g} x the bound"
        moved = max(float((ref["after"][model][k] - before[k]).abs().max()) for k in before)
        assert moved > 1e-4, f"{model} barely moved ({moved}): the comparison would be empty"
    m1, m2 = ref["metrics"], got["metrics"]
    for key in ("train/loss", "train/policy_loss", "train/kl_loss", "train/value_loss"):
        if key in m1:
            assert m2[key] == pytest.approx(m1[key], rel=factor * U, abs=factor * U), key
    # micro-batches: rows of 4 padded; 12 tokens packed (7 forwards on 1 process, 4 on each of 2)
    assert ref["forwards"] == [2]
    assert got["forwards"] == ([7] if run == "packed" else [4])
    if run != "packed":  # rank 1 alone would take 3
        assert got["forwards_rank1"] == [4]
