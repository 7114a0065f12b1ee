"""The recipe's wiring, checked by properties that hold on any CPU (no pinned numbers):

* the per-token anchors, importance weights and keep-mask that reach the policy loss (the fused
  pass, ``models.fused_policy_loss``) are exactly the correction's own output for the batch (for
  every correction; for EWMA at step 0 that output is also checked against θ̄ = θ₀ computed here);
* the importance weights scale the gradient: a batch whose weights are all the TIS cap gives an
  update that scales with the cap;
* the critic's non-finite guard skips the critic's step and nothing else, and the critic's LR
  schedule does not advance for a step its optimizer skipped (no torch warning either);
* a short run learns: the reward rises by a margin (tests/recipes/test_async_ppo.py keeps the
  run pinned to one machine's numbers, which only holds on the machine that pinned it).

The recipe is driven with fixed rollouts (tests.helpers.recipe_on_fixed_batches) in this process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

import minippo.models as models
import minippo.rl as rl
from minippo.config import load_config
from minippo.models import Transformer, init_weights
from minippo.rl.correction import symmetric_mask_weights
from minippo.training.metrics import read_jsonl
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    REPO,
    SWITCH_CORRECTION,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
)

U = torch.finfo(torch.float32).eps / 2
CORRECTIONS = SWITCH_CORRECTION
# 2 epochs x 2 minibatches of 4 rows in micro-batches of 2: anchors shared across all of them
SEVERAL_UPDATES = ["ppo.epochs=2", "ppo.minibatches=2", "ppo.micro_batch_size=2"]


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def config(tmp_path, name: str, *overrides: str):
    return load_config(
        "tiny_cpu", [*FIXED_BATCH_OVERRIDES, f"output_dir={tmp_path / name}", *overrides]
    )


def record_fused_passes(monkeypatch) -> list[tuple]:
    """Wrap the recipe's ``models.fused_policy_loss``; returns the list it fills with each call's
    (spec, output)."""
    calls: list[tuple] = []
    real_fused = models.fused_policy_loss

    def recording_fused(model, input_ids, spec, **kw):
        calls.append((spec, real_fused(model, input_ids, spec, **kw)))
        return calls[-1][1]

    monkeypatch.setattr(models, "fused_policy_loss", recording_fused)  # the recipe's call
    return calls


@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_policy_loss_gets_the_corrections_own_anchors_and_weights(
    tmp_path, monkeypatch, correction
):
    """Every micro-batch's ``FusedLossSpec`` (the recipe's one policy loss) holds the correction's
    own tensors for its rows, or, for anchors formed token by token inside the pass, a function
    that gives what ``minibatch`` gives for those rows."""
    cfg = config(tmp_path, correction, *SEVERAL_UPDATES, *CORRECTIONS[correction])
    calls = record_fused_passes(monkeypatch)
    with recipe_on_fixed_batches(cfg, lambda step: batch) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed, mu_noise=0.5)
        prepared, rows_of_call, given = [], [], []
        real_prepare, real_backward = recipe.correction.prepare, recipe._actor_backward

        def prepare(*args, **kwargs):
            out = real_prepare(*args, **kwargs)
            real_minibatch = out.minibatch

            def minibatch(rows, lp=None):  # what the correction hands out, in call order
                given.append((rows.clone(), lp, real_minibatch(rows, lp)))
                return given[-1][2]

            out.minibatch = minibatch
            prepared.append(out)
            return out

        def actor_backward(mb, rows, *args):
            rows_of_call.append(rows.clone())
            return real_backward(mb, rows, *args)

        recipe.correction.prepare, recipe._actor_backward = prepare, actor_backward
        recipe.train()
        # EWMA: θ₀'s logprobs through the recipe's own scoring pass (the same packed layouts,
        # forwards and trainer threads as the correction's): the same operations in the same
        # order, so the anchors at step 0 (θ̄ = θ₀) equal them bit for bit on any CPU. A padded
        # forward would not: its masked attention rounds differently from the packed buckets.
        if correction == "EWMA":
            actor0 = init_weights(Transformer(recipe.actor.args), seed=cfg.seed)
            with torch.no_grad():
                anchor0 = recipe._scored(partial(recipe._logprobs, actor0), batch)
    assert len(prepared) == 1  # one step: one prepare
    assert len(calls) == len(rows_of_call) == 8  # 2 epochs x 2 minibatches x 2 micro-batches
    covered = torch.cat(rows_of_call).sort().values
    assert torch.equal(covered, torch.arange(8).repeat_interleave(2))  # every row, each epoch
    assert len(given) == 8  # one minibatch call per micro-batch: before the pass or after it
    for (spec, res), rows, (given_rows, lp, want) in zip(calls, rows_of_call, given):
        assert torch.equal(given_rows, rows)
        if spec.token_anchors is None:  # formed before the pass: the very tensors handed out
            assert spec.anchor_logprobs is want.anchor_logprobs
            assert spec.weights is want.weights and spec.keep_mask is want.keep_mask
            assert not spec.anchor_logprobs.requires_grad
        else:  # formed in the pass; minibatch got the pass's own logprobs for the statistics
            assert lp is res.logprobs
            anchor, w, keep = spec.token_anchors(res.logprobs.reshape(-1), slice(None))
            assert torch.equal(anchor.view_as(lp), want.anchor_logprobs)
            assert torch.equal(w.view_as(lp), want.weights)
            assert torch.equal(keep.view_as(lp), want.keep_mask)
    if correction == "EWMA":  # at step 0, θ̄ = θ₀: the anchors are the initial actor's logprobs
        (out,) = prepared
        mask = batch.response_mask
        assert torch.equal(out.anchor_logprobs, torch.where(mask > 0, anchor0, 0.0))
        w = symmetric_mask_weights(out.anchor_logprobs, batch.rollout_logprobs, mask, cap=2.0)
        assert torch.equal(out.weights, w.weights) and torch.equal(out.keep_mask, w.keep)
        assert float(((w.keep == 0) & (mask > 0)).sum()) > 0  # the mask drops some tokens


def test_entropy_coef_enters_every_policy_loss(tmp_path, monkeypatch):
    """``ppo.entropy_coef`` η reaches every micro-batch's fused pass, whose loss is then the
    policy loss − η·aggregate(entropy) (the gradient of that term: tests/unit/
    test_fused_policy_loss.py)."""
    cfg = config(tmp_path, "entropy", *SEVERAL_UPDATES, "ppo.entropy_coef=0.3")
    calls = record_fused_passes(monkeypatch)
    with recipe_on_fixed_batches(cfg, lambda step: batch) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed, mu_noise=0.5)
        recipe.train()
    assert len(calls) == 8
    for spec, out in calls:
        assert spec.entropy_coef == 0.3
        ent = rl.aggregate(
            out.entropy, spec.response_mask, spec.agg_mode,
            global_tokens=spec.global_tokens, global_seqs=spec.global_seqs,
        )  # fmt: skip
        assert float(ent) > 0.1
        want = out.stats.policy_loss - 0.3 * ent
        # the same two float32 scalar ops as the pass: equal up to a rounding of their sizes
        eps = torch.finfo(torch.float32).eps
        assert abs(float(out.loss - want)) <= 2 * eps * (abs(float(want)) + float(ent))


def _tis_update(tmp_path, cap: float) -> tuple[dict, dict]:
    """One GRPO step with TIS at ``cap`` on a batch whose μ is 5 nats below the anchor on every
    token: every ratio exp(a − μ) = e⁵ exceeds the cap, so every weight is the cap."""
    cfg = config(
        tmp_path,
        f"cap{cap}",
        "advantage_estimator=grpo",
        *SWITCH_CORRECTION["TIS"],
        f"correction.cap={cap}",
        "ppo.max_grad_norm=1e9",
    )
    weights_seen = []  # the weights of each fused pass's loss, on its response tokens
    real_fused = models.fused_policy_loss

    def recording_fused(model, input_ids, spec, **kw):
        out = real_fused(model, input_ids, spec, **kw)
        w = spec.weights  # TIS, one update per step: formed from the pass's own logprobs
        if spec.token_anchors is not None:
            w = spec.token_anchors(out.logprobs.reshape(-1), slice(None))[1].view_as(out.logprobs)
        weights_seen.append(w * spec.response_mask)
        return out

    with recipe_on_fixed_batches(cfg, lambda step: batch) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed, mu_noise=0.0)
        batch.rollout_logprobs = batch.rollout_logprobs - 5.0 * batch.response_mask
        before = {k: v.detach().clone() for k, v in recipe.actor.state_dict().items()}
        models.fused_policy_loss = recording_fused  # the recipe's call
        try:
            recipe.train()
        finally:
            models.fused_policy_loss = real_fused
        after = {k: v.detach().clone() for k, v in recipe.actor.state_dict().items()}
    mask = batch.response_mask
    for w in weights_seen:
        assert torch.equal(w[w != 0], torch.full_like(w[w != 0], cap))
    assert sum(int((w != 0).sum()) for w in weights_seen) == int(mask.sum())
    return before, after


def test_importance_weights_scale_the_gradient(tmp_path):
    """SGD without clipping: the update is lr·g, and g is linear in the per-token weights, so
    weights 5 instead of 2 give 2.5 times the update."""
    before, a2 = _tis_update(tmp_path, 2.0)
    before5, a5 = _tis_update(tmp_path, 5.0)
    worst = 0.0
    for k in before:
        assert torch.equal(before[k], before5[k])
        d2, d5 = a2[k] - before[k], a5[k] - before[k]
        # the gradients are the same float32 sums with every term scaled by 2.5 (the fused pass's
        # token gradient c_t·w_t·∂L/∂lp_t, and all that is linear in it, up to one rounding per
        # term and per partial sum: ≤ 2N·u relative to the tensor's largest update, N = 88
        # positions), and each new weight is rounded once (u·|θ|)
        bound = 2 * 88 * U * d5.abs().max() + U * (a5[k].abs() + 2.5 * a2[k].abs()) * 2
        excess = float(((d5 - 2.5 * d2).abs() / bound.clamp(min=1e-30)).max())
        worst = max(worst, excess)
        assert excess <= 1.0, (k, excess)
    assert max(float((a2[k] - before[k]).abs().max()) for k in before) > 1e-3


@pytest.mark.filterwarnings("error::UserWarning")  # lr_scheduler.step() before optimizer.step()
def test_non_finite_critic_loss_skips_only_the_critic_step(tmp_path, monkeypatch):
    """The critic's only optimizer step of the run is skipped: the critic and its optimizer state
    stay as they were, and its LR schedule does not advance (a schedule counts the steps in which
    its optimizer stepped: torch warns when one advances before its optimizer ever stepped); the
    actor trains and its schedule advances."""
    cfg = config(tmp_path, "nan_critic", "ppo.max_grad_norm=1e9")
    real_value_loss = rl.value_loss

    def nan_value_loss(*args, **kwargs):
        loss, stats = real_value_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(rl, "value_loss", nan_value_loss)
    with recipe_on_fixed_batches(cfg, lambda step: batch) as recipe:
        batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed)
        actor0 = {k: v.detach().clone() for k, v in recipe.actor.state_dict().items()}
        critic0 = {k: v.detach().clone() for k, v in recipe.critic.state_dict().items()}
        recipe.train()
        for k, v in recipe.critic.state_dict().items():
            assert torch.equal(v, critic0[k]), k  # the critic step was skipped
        assert any(not torch.equal(v, actor0[k]) for k, v in recipe.actor.state_dict().items())
        assert recipe.critic_guard.skipped_total == 1 and recipe.actor_guard.skipped_total == 0
        assert recipe.critic_scheduler.last_epoch == 0  # not advanced: no critic step was taken
        assert recipe.scheduler.last_epoch == 1  # the actor stepped: its schedule advanced
        assert recipe.critic_optimizer.state == {} or all(
            torch.isfinite(t).all()
            for s in recipe.critic_optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
    (row,) = read_jsonl(tmp_path / "nan_critic" / "metrics.jsonl")
    assert row["train/nonfinite_skipped_total"] == 1.0
    assert math.isnan(row["train/critic_grad_norm"]) and math.isfinite(row["train/grad_norm"])


def test_a_short_run_raises_the_reward(tmp_path):
    """The shipped tiny_cpu run for its first 20 steps (its LR schedule ends at step 40 whatever
    total_steps is): from chance (~0.02) the mean reward rises by more than 0.15 (as shipped:
    +0.63 to +0.91 over seeds 0-5 on a 2-core AMD EPYC; +0.47 to +0.73 at lr 3e-3; +0.20 to +0.33
    with 4 samples per prompt; the reward of one step has a standard error of ~0.02 over its 256
    samples). ~25 s."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "minippo._cli.main", "run", "async_ppo", "--config", "tiny_cpu",
            "total_steps=20", f"output_dir={out}",
            "progress_bar=false", "checkpoint.export_hf=false",
        ],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reward = [r["rollout/reward_mean"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(reward) == 20
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert first < 0.1, reward  # chance level at the start
    assert last - first > 0.15, reward
