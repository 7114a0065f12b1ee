"""Multi-turn episodes through the real CLI: a user's environment class in its own file runs
through ``env._component_`` (training and eval), impossible budgets and a missing class are
refused by ``validate`` before any model exists, and (slow) the shipped configs learn."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minippo.config import ConfigError, load_config
from minippo.training import preflight
from minippo.training.metrics import read_jsonl
from tests.helpers import SWITCH_CORRECTION
from tests.recipes.seeds import SeedCount, check_seed_count, run_seeds
from tests.recipes.test_async_ppo import FAST, run_recipes

REPO = Path(__file__).resolve().parents[2]

USER_ENV = '''
from minippo.env import StepResult


class EchoTwice:
    """Turn 0 is answered with the prompt's answer text; turn 1 scores a copy of it."""

    stop_tokens = ["."]

    def __init__(self, bonus: float = 0.0):
        self.bonus = bonus

    def reset(self, prompt, seed):
        return {"answer": prompt.answer, "seen": []}

    def step(self, state, turn):
        state["seen"].append(turn.text)
        if turn.index == 0:
            return StepResult(observation=":" + state["answer"] + "=")
        right = sum(a == b for a, b in zip(turn.text, state["answer"]))
        return StepResult(reward=right / len(state["answer"]) + self.bonus * len(state["seen"]))
'''


VALIDATION = (
    "{every_n_steps: 2, before_train: true, samples_per_prompt: 2, temperature: null, "
    "max_new_tokens: null, dataset: {_component_: minippo.data.tasks.digit_task, op: reverse, "
    'length: 3, alphabet: "0123", num_prompts: 4, seed: 1}}'
)


def cli(*args: str, pythonpath: Path | None = None, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "minippo._cli.main", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout,
    )  # fmt: skip


def test_a_users_environment_in_its_own_file_trains_and_evaluates(tmp_path):
    (tmp_path / "my_envs.py").write_text(USER_ENV)
    out = tmp_path / "run"
    proc = cli(
        "run", "async_ppo", "--config", "tiny_multiturn_cpu", "env._component_=my_envs.EchoTwice",
        "~env.retry_reward", "+env.bonus=0.0", "total_steps=2", "rollout.groups_per_batch=8",
        f"output_dir={out}", "progress_bar=false", "engine.in_process=true",
        "checkpoint.export_hf=false", f"eval={VALIDATION}", pythonpath=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = read_jsonl(out / "metrics.jsonl")
    # validation during training runs the same episodes (before step 0 and after the last)
    assert [r["eval/turns_mean"] for r in logged if "eval/samples" in r] == [2.0, 2.0]
    rows = [r for r in logged if "rollout/reward_mean" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 1.0 <= r["rollout/turns_mean"] <= 2.0
        assert r["rollout/obs_tokens_mean"] > 0  # ":103=" after every turn 0
        assert r["rollout/env_errors"] == 0 and r["rollout/env_timeouts"] == 0
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    # the eval recipe runs the same environment from the training checkpoint
    proc = cli(
        "run", "eval", "--config", "tiny_eval_cpu", "+env._component_=my_envs.EchoTwice",
        f"training_checkpoint={out / 'checkpoints'}", "checkpoint_path=null",
        "dataset.op=reverse", "dataset.length=3", "dataset.num_prompts=4",
        "sampling.max_new_tokens=11", "+multi_turn.max_turn_tokens=3",
        "+multi_turn.max_turns=2", f"output_dir={tmp_path / 'eval'}", "progress_bar=false",
        pythonpath=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "eval/turns_mean" in proc.stdout


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["multi_turn.max_turn_tokens=12"], "multi_turn.max_turn_tokens (12) exceeds "
         "rollout.max_new_tokens (11)"),
        (["multi_turn.max_turns=12"], "rollout.max_new_tokens (11) cannot hold "
         "multi_turn.max_turns (12)"),
        (["env._component_=no_such_module.Env"], "env._component_"),
        (["env=null"], "multi_turn.max_turn_tokens is set but env is null"),
        (["multi_turn.on_error=ignore"], "multi_turn.on_error"),
    ],
)  # fmt: skip
def test_validate_refuses_impossible_multi_turn_settings(overrides, line):
    """The checks `minippo validate` and the recipe run before any model exists."""
    cfg = load_config("tiny_multiturn_cpu", overrides)
    with pytest.raises(ConfigError) as info:
        preflight.check_async_ppo_config(cfg, world_size=1, distributed=False)
    assert line in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_validate_accepts_the_shipped_multi_turn_configs():
    for name in ("tiny_multiturn_cpu", "tiny_multiturn_tool_cpu"):
        preflight.check_async_ppo_config(load_config(name), world_size=1, distributed=False)


def learned(config: str, estimator: str, seed: int, out: Path) -> float:
    """The config as shipped (one estimator, one seed): its mean reward over the last 5 steps
    (the figure benchmarks/learning_sweep.py reports)."""
    proc = cli(
        "run", "async_ppo", "--config", config, f"advantage_estimator={estimator}",
        f"seed={seed}", f"output_dir={out}", "progress_bar=false", "checkpoint.export_hf=false",
        timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "rollout/reward_mean" in r]
    assert rows[0]["rollout/reward_mean"] < 0.1  # from chance
    return sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5


# Measured with benchmarks/learning_sweep.py over seeds 0-5 and both estimators, the configs as
# shipped (2-core AMD EPYC, torch 2.13.0; docs/multi_turn.md "Results"): runs below 0.8 over the
# last 5 of 200 steps: retry 1 of 12 (GAE seed 2: 0.795), tool 0 of 12. Six seeds, at least 4:
# luck fails it <= 5% of the time, a job that has stopped learning (9 in 10 missing) never passes.
RETRY_SEEDS = SeedCount(seeds=range(6), at_least=4, bar=0.8, bad=(9, 10), good=(1, 12))
TOOL_SEEDS = SeedCount(seeds=range(6), at_least=4, bar=0.8, bad=(9, 10), good=(0, 12))


@pytest.mark.slow  # 6 runs of 200 steps, two at a time, per estimator
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_tiny_multiturn_cpu_learns(tmp_path, estimator):
    scores = run_seeds(
        lambda s: learned("tiny_multiturn_cpu", estimator, s, tmp_path / f"s{s}"),
        RETRY_SEEDS.seeds,
    )
    check_seed_count(scores, RETRY_SEEDS, f"tiny_multiturn_cpu {estimator}")


@pytest.mark.slow  # 6 runs of 200 steps, two at a time, per estimator
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_tiny_multiturn_tool_cpu_learns_to_call_the_tool_and_read_it(tmp_path, estimator):
    scores = run_seeds(
        lambda s: learned("tiny_multiturn_tool_cpu", estimator, s, tmp_path / f"s{s}"),
        TOOL_SEEDS.seeds,
    )
    for s in TOOL_SEEDS.seeds:  # every run calls the tool, then answers with its result
        rows = [
            r for r in read_jsonl(tmp_path / f"s{s}" / "metrics.jsonl") if "rollout/turns_mean" in r
        ]
        assert rows[0]["rollout/turns_mean"] < 1.2 and rows[-1]["rollout/turns_mean"] > 1.9
    check_seed_count(scores, TOOL_SEEDS, f"tiny_multiturn_tool_cpu {estimator}")


CORRECTIONS = SWITCH_CORRECTION  # EWMA: the config's
SCHEDULES = {  # both cut episodes between publishes: partial rollouts on
    "overlap": ["rollout.partial_rollout=true"],
    "alternate": [
        "rollout.mode=alternate",
        "rollout.oversample=1.5",
        "rollout.partial_rollout=true",
    ],
}


@pytest.mark.slow  # 10 runs of 3 steps in one process, ~1 min
def test_every_correction_runs_multi_turn_episodes_in_both_schedules(tmp_path):
    """Multi-turn episodes train with every correction in both schedules (TorchEngine): each
    run's steps are finite, hold two-turn episodes, and keep_old_actor scores every token with
    the snapshot of its own version (no mismatch), across turns and cut episodes."""
    names = [(c, m) for c in CORRECTIONS for m in SCHEDULES]
    runs = [
        [
            *FAST,
            "total_steps=3",
            f"output_dir={tmp_path / f'{c}-{m}'}",
            *CORRECTIONS[c],
            *SCHEDULES[m],
        ]
        for c, m in names
    ]
    results = run_recipes(runs, config="tiny_multiturn_cpu")
    for name, err in zip(names, results, strict=True):
        assert err is None, f"{name}: {err}"
    for c, m in names:
        rows = read_jsonl(tmp_path / f"{c}-{m}" / "metrics.jsonl")
        assert len(rows) == 3, (c, m)
        for r in rows:
            assert r["rollout/turns_mean"] > 1.0 and math.isfinite(r["train/loss"]), (c, m, r)
        if c == "KeepOldActor":
            assert all(r["correction/version_mismatches"] == 0.0 for r in rows), (c, m)
        if m == "alternate":
            assert "rollout/carried_over" in rows[0], (c, m)
