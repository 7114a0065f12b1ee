"""Validation during training (``eval`` section): logged as ``eval/*``, and the run trains exactly
as without it (seeded requests, no global RNG, the rollout queue idle meanwhile)."""

import pytest

from minippo.training.metrics import read_jsonl
from tests.helpers import minippo_here
from tests.recipes.test_async_ppo import FAST, assert_same, run_recipes, stable

EVAL = (
    "eval={every_n_steps: 2, before_train: true, samples_per_prompt: 4, temperature: null, "
    "max_new_tokens: null, dataset: {_component_: minippo.data.tasks.digit_task, op: copy, "
    "length: 4, alphabet: '0123', num_prompts: 8, seed: 99}}"
)


@pytest.mark.parametrize("mode", ["overlap", "alternate"])
def test_validation_is_logged_and_changes_nothing_in_training(tmp_path, mode):
    common = [*FAST, "total_steps=4", f"rollout.mode={mode}"]
    if mode == "alternate":
        common.append("rollout.oversample=1.5")
    with_eval, without = tmp_path / "with", tmp_path / "without"
    runs = [[*common, f"output_dir={with_eval}", EVAL], [*common, f"output_dir={without}"]]
    assert run_recipes(runs) == [None, None]
    rows = read_jsonl(with_eval / "metrics.jsonl")
    evals = [r for r in rows if "eval/reward_mean" in r]
    train = [r for r in rows if "eval/reward_mean" not in r]
    # before training, and after steps 2 and 4 (steps done); 8 prompts x 4 samples each time
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["eval/samples"] == 32 and 0 <= r["eval/pass@4"] <= 1 for r in evals)
    plain = read_jsonl(without / "metrics.jsonl")
    assert [r["step"] for r in train] == [r["step"] for r in plain] == [0, 1, 2, 3]
    for a, b in zip(train, plain):
        assert_same(stable(a), stable(b))


def test_eval_every_must_follow_the_sync_cycle(tmp_path):
    proc = minippo_here("validate", "--config", "tiny_cpu", "rollout.sync_every=3", EVAL)
    assert proc.returncode == 1
    assert "eval.every_n_steps (2) must be a multiple of rollout.sync_every (3)" in proc.stderr


def test_final_validation_needs_a_whole_sync_cycle():
    """The last validation runs right after the last publish: total_steps must end a cycle."""
    proc = minippo_here(
        "validate", "--config", "tiny_cpu", "rollout.sync_every=2", "total_steps=7", EVAL
    )
    assert proc.returncode == 1
    assert "total_steps (7) must be a multiple of rollout.sync_every (2) when eval is set" in (
        proc.stderr
    )
    assert "total_steps=6" in proc.stderr and "Traceback" not in proc.stderr
