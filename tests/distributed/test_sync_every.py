"""``rollout.sync_every=3``: every step of a sync cycle anchors with the weights the engines hold.

The recipe trains 4 steps on fixed rollouts with TIS (anchor = "the policy before this update").
Versions count publishes: steps 0-2 train from version 0 (the initial weights), the publish after
step 2 is version 1, step 3 trains from it. The anchors the recipe computes at every step must
equal, bit for bit, a fresh unsharded model holding the weights of the version the step trains
from; under 1 process and under 2 FSDP2 ranks (each rank its 4 rows). Without the published copy,
steps 1 and 2 would anchor with weights already moved by the cycle's earlier steps and differ.

Why bit for bit holds on every CPU: the fresh model is scored through the recipe's own scoring
pass (``recipe._scored``: the rows ``correction.prepare`` got, after rank balancing, in the same
packed layouts and forwards of ``ppo.score_micro_batch_size`` rows), in the recipe's process at
the thread count it set (``cpu_threads``). Both sides then run the same kernels on the same
shapes in the same order; FSDP2's forward computes on the all-gathered fp32 weights, a copy of
the published ones. A padded forward would not do: its attention is one masked SDPA call over
the padded rows where the packed pass makes causal calls over length buckets, and the two round
differently (up to 2.4e-7 in a logprob on a 2-core AMD EPYC; equal on the Intel Xeon CI ran on).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from minippo.config import load_config
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
    run_on_ranks,
)

OVERRIDES = [
    *FIXED_BATCH_OVERRIDES,
    "total_steps=4",
    "rollout.sync_every=3",
    "correction._component_=minippo.rl.correction.TIS",
    "~correction.reset_below",
]


def run_steps(out: Path, rank: int, world: int) -> dict:
    """The anchors of each step, the published versions (full weights, gathered) and what a
    fresh model holding the step's version scores through the recipe's scoring pass; on every
    rank, for the rows the step's correction got."""
    from minippo.models import Transformer
    from minippo.parallel import gather_full_state_dict

    cfg = load_config("tiny_cpu", [*OVERRIDES, f"output_dir={out}-{world}"])
    anchors, published, steps, scored_rows = [], {}, [], []
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        real_prepare, real_publish = recipe.correction.prepare, recipe._publish
        # setup published version 0 before this wrapper: the actor holds it until the first step
        published[0] = {k: v.clone() for k, v in gather_full_state_dict(recipe.actor).items()}

        def prepare(b, actor, *, step):
            steps.append(step)
            scored_rows.append(b)
            out = real_prepare(b, actor, step=step)
            anchors.append(out.anchor_logprobs.clone())
            return out

        def publish(version):
            full = gather_full_state_dict(recipe.actor)
            published[version] = {k: v.clone() for k, v in full.items()}
            real_publish(version)

        recipe.correction.prepare, recipe._publish = prepare, publish
        recipe.train()
        expected = []
        for version, rows in zip(steps, scored_rows):
            model = Transformer(recipe.actor.args)
            missing, unexpected = model.load_state_dict(published[version], strict=False)
            assert not unexpected and set(missing) <= {"output.weight"}  # tied: not gathered
            assert not missing or model.output.weight is model.tok_embeddings.weight
            with torch.no_grad():  # the recipe's score_fn, with the fresh model
                lp = recipe._scored(partial(recipe._logprobs, model), rows)
            expected.append(torch.where(rows.response_mask > 0, lp, 0.0))  # 0 on padding
    return {"versions": steps, "anchors": anchors, "expected": expected, "published": published}


def check(result: dict) -> None:
    assert result["versions"] == [0, 0, 0, 1]
    assert sorted(result["published"]) == [0, 1]
    for step, (got, want) in enumerate(zip(result["anchors"], result["expected"])):
        assert torch.equal(got, want), f"step {step}: anchors differ from the published weights"
    # the actor moved within the cycle: steps 1 and 2 would differ with its current weights
    p0, p1 = result["published"][0], result["published"][1]
    assert any(not torch.equal(p0[k], p1[k]) for k in p0)


def test_anchors_inside_a_sync_cycle_are_the_published_weights_one_process(tmp_path):
    threads = torch.get_num_threads()
    try:
        check(run_steps(tmp_path / "run", 0, 1))
    finally:
        torch.set_num_threads(threads)  # the recipe sets cpu_threads


def _on_rank(rank: int, world: int, out: str) -> None:
    import minippo.parallel as parallel

    parallel.init_distributed()
    result = run_steps(Path(out) / "run", rank, world)  # the recipe's cleanup ends the group
    torch.save(result, Path(out) / f"rank{rank}.pt")


def test_anchors_inside_a_sync_cycle_are_the_published_weights_two_ranks(tmp_path):
    run_on_ranks(_on_rank, str(tmp_path))
    for rank in range(2):
        check(torch.load(tmp_path / f"rank{rank}.pt", weights_only=False))
