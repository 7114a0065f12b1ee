"""The async PPO recipe end to end on the tiny CPU config (fp32, fixed seed).

Runs go through the real CLI (``python -m minippo._cli.main run async_ppo --config tiny_cpu ...``)
or, to pay the import and start-up cost once, several ``recipe_main`` calls in one subprocess.
Pinned numbers are reproducible because the rollout queue's version policy is deterministic (batch
``s`` always starts once version ``s - max_staleness`` is published), sampling uses per-request
seeds, and the minibatch order uses a per-step generator.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from minippo.training.metrics import read_jsonl
from tests.helpers import SWITCH_CORRECTION, minippo_here
from tests.recipes.seeds import SeedCount, check_seed_count, run_seeds

REPO = Path(__file__).resolve().parents[2]
# small and fast: 8 prompts x 4 samples, 2 minibatches of 16 rows in micro-batches of 8
SMALL = [
    "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=8",
    "progress_bar=false",
    "checkpoint.export_hf=false",
]
FAST = [*SMALL, "engine.in_process=true"]  # the engine loop in a thread: no process start-up
# metrics that do not depend on timing (queue counters and perf/ do)
STABLE_PREFIXES = ("train/", "correction/")
STABLE_ROLLOUT = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/staleness_mean")


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``minippo <args>`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "minippo._cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=timeout,
    )


def run_recipes(
    runs: list[list[str]],
    timeout: float = 300,
    nan_loss_at_steps: tuple[int, ...] = (),
    config: str = "tiny_cpu",
) -> list[str | None]:
    """Run ``recipe_main(load_config(config, overrides))`` for each override list, in order,
    in one subprocess; returns None per successful run, else the error's text.

    ``nan_loss_at_steps``: the actor's loss share and gradients are made NaN at these training
    steps (by patching the recipe's ``_actor_backward``, whichever loss path it takes), to
    exercise the non-finite guard."""
    code = textwrap.dedent(
        """
        import json, runpy, sys, traceback
        from minippo.config import load_config
        if __name__ == "__main__":
            main = runpy.run_path(sys.argv[1])["recipe_main"]
            nan_steps, config = json.loads(sys.argv[3]), sys.argv[4]
            if nan_steps:
                recipe_cls = main.__globals__["AsyncPPORecipe"]
                real_updates, real_backward = recipe_cls._ppo_updates, recipe_cls._actor_backward
                nan_now = [False]

                def backward(self, *args, **kwargs):  # a NaN loss: NaN share, NaN gradients
                    shares, per_token, logprobs = real_backward(self, *args, **kwargs)
                    if nan_now[0]:
                        shares["train/loss"] = shares["train/loss"] * float("nan")
                        for p in self.actor.parameters():
                            if p.grad is not None:
                                p.grad.fill_(float("nan"))
                    return shares, per_token, logprobs

                def updates(self, step, *args, **kwargs):
                    nan_now[0] = step in nan_steps
                    return real_updates(self, step, *args, **kwargs)

                recipe_cls._ppo_updates, recipe_cls._actor_backward = updates, backward
            results = []
            for overrides in json.loads(sys.argv[2]):
                try:
                    main(load_config(config, overrides))
                    results.append(None)
                except Exception as e:
                    results.append(f"{type(e).__name__}: {e}\\n" + traceback.format_exc())
            print("RESULTS=" + json.dumps(results))
        """
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(REPO / "recipes" / "async_ppo.py"),
            json.dumps(runs),
            json.dumps(list(nan_loss_at_steps)),
            config,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=timeout,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS=")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS=") :])


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(STABLE_PREFIXES) or k in STABLE_ROLLOUT}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        both_nan = isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])
        assert both_nan or a[k] == b[k], (k, a[k], b[k])


# pinned from `minippo run async_ppo --config tiny_cpu total_steps=3 <SMALL>` (fp32, seed 0)
PINNED_REWARD = [0.0, 0.015625, 0.0078125]
PINNED_LAST = {
    # the minibatch losses (2 micro-batches of 8 rows: the sum of their shares)
    "train/policy_loss": -0.012740064412355423,
    "train/value_loss": 0.0010528456841711886,
    "train/approx_kl": 0.002077813861263174,  # token-weighted over the micro-batches
}


def test_cli_run_pinned_metrics(tmp_path):
    """Same-machine check: the pinned values are one machine's float32 results (another CPU's
    kernels sum in another order and the run diverges after a few steps). The properties that
    hold on any CPU are in test_recipe_properties.py (tests/README.md)."""
    out = tmp_path / "run"
    small = [x for x in SMALL if x != "checkpoint.export_hf=false"]
    proc = cli(
        "run",
        "async_ppo",
        "--config",
        "tiny_cpu",
        "total_steps=3",
        f"output_dir={out}",
        *small,
        "lr_scheduler.warmup_steps=0",
        "gae.value_lam=null",
        "optimizer.betas=[0.9,0.99]",  # the settings they were pinned with
        "ppo.max_update_kl=null",
        "optimizer.lr=3.0e-3",
        "lr_scheduler.total_steps=3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"metrics: {out / 'metrics.jsonl'}" in proc.stdout
    assert f"checkpoint: {out / 'checkpoints' / 'step_000003'}" in proc.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/reward_mean"] for r in rows] == pytest.approx(PINNED_REWARD, rel=1e-6)
    for k, v in PINNED_LAST.items():
        assert rows[-1][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
    # async: step 0 uses the initial weights, later steps tokens one version old
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[-1]["correction/ewma_resets"] == 0.0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # the HF export is the final actor, bit for bit
    from minippo.models import from_pretrained

    exported = from_pretrained(out / "hf_export").state_dict()
    saved = _actor_weights(out / "checkpoints" / "step_000003", tmp_path)
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k


def test_every_correction_and_grpo_and_kl_run(tmp_path):
    S = SWITCH_CORRECTION
    runs = {
        "rollout_logprobs": S["RolloutLogprobs"],
        "tis": S["TIS"],
        "keep_old_actor": S["KeepOldActor"],
        "keep_old_actor_partial": [*S["KeepOldActor"], "rollout.partial_rollout=true"],
        "loglinear_prox": S["LogLinearProx"],
        "none_sync": ["correction=null", "rollout.max_staleness=0"],
        "grpo_kl_loss": [
            "advantage_estimator=grpo",
            "kl.coef=0.05",
            "kl.mode=loss",
            "kl.estimator=k3",
        ],
        "gae_kl_reward_warmup": ["kl.coef=0.05", "critic.warmup_steps=1"],
        "scored_in_chunks": ["kl.coef=0.05", "ppo.score_micro_batch_size=5"],
    }
    overrides = [
        [*FAST, "total_steps=2", f"output_dir={tmp_path / name}", *extra]
        for name, extra in runs.items()
    ]
    results = run_recipes(overrides)
    for name, err in zip(runs, results):
        assert err is None, f"{name}: {err}"
    for name in runs:
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert len(rows) == 2, name
        assert all(
            math.isfinite(r["train/value_loss" if "grpo" not in name else "train/loss"])
            for r in rows
        )
    for name in ("keep_old_actor", "keep_old_actor_partial"):
        kor = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert [r["correction/version_mismatches"] for r in kor] == [0.0, 0.0]
    grpo = read_jsonl(tmp_path / "grpo_kl_loss" / "metrics.jsonl")
    assert "train/value_loss" not in grpo[0] and "train/kl_mean" in grpo[0]
    warm = read_jsonl(tmp_path / "gae_kl_reward_warmup" / "metrics.jsonl")
    assert [r["train/actor_updated"] for r in warm] == [0.0, 1.0]
    assert "train/kl_ref_mean" in warm[0]


def test_activation_checkpointing_run_matches_plain_run(tmp_path):
    runs = [
        [*FAST, "total_steps=2", f"output_dir={tmp_path / 'plain'}"],
        [*FAST, "total_steps=2", f"output_dir={tmp_path / 'ac'}", "activation_checkpointing=true"],
    ]
    assert run_recipes(runs) == [None, None]
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    ac = read_jsonl(tmp_path / "ac" / "metrics.jsonl")
    for a, b in zip(plain, ac):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        for k in ("train/policy_loss", "train/value_loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow  # compiles the actor's and critic's blocks: ~1 min on a loaded 2-core machine
def test_compiled_run_matches_plain_run(tmp_path):
    """``compile: true``: the same 2 steps as the eager run, up to the fp32 rounding of the fused
    blocks (tests/unit/test_compile_blocks.py); checkpoints and the HF export keep their names."""
    common = [*FAST, "total_steps=2", "checkpoint.export_hf=true"]
    runs = [
        [*common, f"output_dir={tmp_path / 'plain'}"],
        [*common, f"output_dir={tmp_path / 'compiled'}", "compile=true"],
    ]
    assert run_recipes(runs, timeout=900) == [None, None]
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    compiled = read_jsonl(tmp_path / "compiled" / "metrics.jsonl")
    for a, b in zip(plain, compiled):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        for k in ("train/policy_loss", "train/value_loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    # the HF export holds the same tensor names (no _orig_mod prefix from compiling)
    from safetensors import safe_open

    def names(run: str) -> list[str]:
        files = sorted((tmp_path / run / "hf_export").glob("*.safetensors"))
        assert files, run
        return sorted(k for f in files for k in safe_open(f, "pt").keys())  # noqa: SIM118

    assert names("compiled") == names("plain")


RESUME_CASES = {
    "EWMA": [],
    # its snapshot of version 1 serves the saved batch of step 2
    "KeepOldActor": ["correction._component_=minippo.rl.correction.KeepOldActor"],
    # stopped inside a sync cycle (steps 0-2): step 2 anchors with the saved published weights,
    # and the engine is refilled with them, not with the actor's
    "TIS_sync_every_3": [
        "correction._component_=minippo.rl.correction.TIS",
        "rollout.sync_every=3",
    ],
    # the carried groups (partial tokens included) are saved and continue after the resume
    "alternate": ["rollout.mode=alternate", "rollout.oversample=1.5"],
    # multi-turn episodes carried mid-episode (a tool was called in round 0 of the step, the
    # answer turn is left): the environment's state is saved with their tokens
    "multi_turn_alternate": [
        "rollout.mode=alternate",
        "rollout.oversample=2.0",
        "rollout.max_new_tokens=9",
        "dataset._component_=minippo.data.tasks.arithmetic_task",
        "~dataset.op",
        "~dataset.length",
        "~dataset.alphabet",
        "+dataset.min_operand=10",
        "+dataset.max_operand=49",
        "+env._component_=minippo.data.tasks.Calculator",
        "+multi_turn.max_turns=2",
        "+multi_turn.max_turn_tokens=3",
    ],
    # packed forwards in micro-batches of a token budget, scoring passes too
    "token_budget": [
        "ppo.micro_batch_size=null",
        "ppo.max_tokens_per_micro_batch=40",
        "ppo.score_max_tokens_per_micro_batch=100",
    ],
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_equals_uninterrupted_run(tmp_path, case):
    full, part = tmp_path / "full", tmp_path / "part"
    # the LR schedule's horizon is fixed, so the run stopped at step 2 decays like the full one
    common = [*FAST, "checkpoint.every_n_steps=2", "lr_scheduler.total_steps=4"]
    common += RESUME_CASES[case]
    if case in ("KeepOldActor", "TIS_sync_every_3"):
        common += ["~correction.reset_below"]
    results = run_recipes(
        [
            [*common, "total_steps=4", f"output_dir={full}"],
            [*common, "total_steps=2", f"output_dir={part}"],  # "killed" after step 2
            [*common, "total_steps=4", f"output_dir={part}", "resume_from=latest"],
        ]
    )
    assert results == [None, None, None], results
    a = read_jsonl(full / "metrics.jsonl")
    b = read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in a] == [0, 1, 2, 3] and [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        assert_same(stable(ra), stable(rb))
    if case in ("EWMA", "KeepOldActor"):
        assert a[3]["rollout/staleness_mean"] == 1.0  # the resumed batch was the saved, stale one


def test_bad_configs_fail_before_anything_is_built(tmp_path):
    out = tmp_path / "never"
    # async + critic + no correction: the fail-fast correction check lists the options
    proc = minippo_here(
        "run", "async_ppo", "--config", "tiny_cpu", "correction=null", f"output_dir={out}"
    )
    assert proc.returncode != 0
    assert "correction._component_=minippo.rl.correction.EWMA" in proc.stderr
    assert "max_staleness=1" in proc.stderr
    # shape checks name the values and the fix
    main = __import__("runpy").run_path(str(REPO / "recipes" / "async_ppo.py"))["recipe_main"]
    from minippo.config import load_config

    cases = {
        "ppo.minibatches=3": "must be divisible by ppo.minibatches (3); pick ppo.minibatches among",
        "ppo.micro_batch_size=7": "divisible by ppo.micro_batch_size (7)",
        "advantage_estimator=vtrace": "must be one of ['gae', 'grpo'], got 'vtrace'",
        "kl.mode=both": "kl.mode must be one of ['loss', 'reward'], got 'both'",
        "critic.warmup_steps=99": "critic.warmup_steps (99) must be in [0, total_steps (60))",
        "ppo.score_micro_batch_size=0": "score_micro_batch_size must be an integer >= 1 or null, got 0",
        "dtype=bf16": "run `minippo run --nproc-per-node 1 async_ppo ...`, or set dtype=fp32",
        "kl.coef=0.1 kl.mode=loss kl.estimator=k1": "set kl.estimator=k2",
        "ppo.micro_batch_size=4 ppo.max_tokens_per_micro_batch=64": "set one of them to null",
        "ppo.pack=false ppo.score_max_tokens_per_micro_batch=64": "set ppo.pack=true",
    }
    for override, message in cases.items():
        cfg = load_config("tiny_cpu", [f"output_dir={out}", *override.split()])
        with pytest.raises(ValueError) as e:
            main(cfg)
        assert message in str(e.value), (override, str(e.value))
    assert not out.exists()  # nothing was created: no logger, no checkpoint, no engine


def _actor_weights(ckpt: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp / f"{ckpt.name}.pt")
    sd = torch.load(tmp / f"{ckpt.name}.pt", weights_only=False)
    return {k: v for k, v in sd["actor"].items()}


def test_nan_loss_is_skipped_then_repeated_nans_stop_the_run(tmp_path):
    skip, stop = tmp_path / "skip", tmp_path / "stop"
    common = [*FAST, "total_steps=3", "checkpoint.every_n_steps=1", "checkpoint.keep_last=null"]
    results = run_recipes(
        [
            [*common, f"output_dir={skip}"],
            [*common, f"output_dir={stop}", "max_consecutive_nonfinite=2"],
        ],
        nan_loss_at_steps=(1,),
    )
    assert results[0] is None, results[0]
    rows = read_jsonl(skip / "metrics.jsonl")
    assert [r["train/nonfinite_skipped_total"] for r in rows] == [0.0, 2.0, 2.0]  # 2 minibatches
    assert math.isnan(rows[1]["train/grad_norm"]) and math.isfinite(rows[2]["train/grad_norm"])
    w1, w2, w3 = (
        _actor_weights(skip / "checkpoints" / f"step_00000{i}", tmp_path) for i in (1, 2, 3)
    )
    for k in w1:  # step 1 (between checkpoints 1 and 2) changed nothing; step 2 trained again
        assert torch.equal(w1[k], w2[k]), k
        assert torch.isfinite(w3[k]).all(), k
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)

    assert results[1] is not None and "NonFiniteError" in results[1]
    assert "2 optimizer steps in a row had a non-finite loss" in results[1]
    assert "max_consecutive_nonfinite" in results[1]
    assert (stop / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_every_shipped_config_validates():
    from minippo._cli import registry
    from minippo.config import load_config, validate
    from minippo.rl.correction import validate_async_off_policy_correction

    for recipe in registry.RECIPES:  # each config with the checks of the recipe it is for
        recipe_file = REPO / "recipes" / recipe.file_path
        validate_config = __import__("runpy").run_path(str(recipe_file))["validate_config"]
        for config in recipe.configs:
            cfg = load_config(REPO / "configs" / config.file_path)
            assert validate(cfg) == [], config.name
            if "rollout" in cfg:
                validate_async_off_policy_correction(cfg)
            validate_config(cfg, config.nproc_per_node or 1)


SHIPPED = ["progress_bar=false", "checkpoint.export_hf=false"]  # what the sweeps ran: same numbers
QUIET = [*SHIPPED, "engine.in_process=true"]


def tiny_cpu_seeds(tmp_path: Path, seeds, *overrides: str) -> dict[int, list[dict]]:
    """Run tiny_cpu (60 steps) for each of ``seeds`` with ``overrides``, two at a time; seed ->
    its metric rows."""

    def one(seed: int) -> list[dict]:
        out = tmp_path / f"seed{seed}"
        proc = cli(
            "run", "async_ppo", "--config", "tiny_cpu", *overrides, f"seed={seed}",
            f"output_dir={out}", timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_jsonl(out / "metrics.jsonl")

    return run_seeds(one, seeds)


def last_5(runs: dict[int, list[dict]]) -> dict[int, float]:
    """Seed -> the mean reward of its last 5 steps."""
    return {
        seed: sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5 for seed, rows in runs.items()
    }


# tiny_cpu as shipped: seeds whose final reward (the mean of the last 5 steps) stays below 0.9 in
# sweeps (benchmarks/learning_sweep.py, 2-core AMD EPYC, torch 2.13.0; docs/learning.md): 8 of 60
# with the first settings (4 samples per prompt, no lr warm-up, critic targets at lam), 0 of 180
# as shipped. So at least 55 of 59 seeds must reach 0.9 (tests/unit/test_seed_counts.py checks
# the choice).
TINY_CPU_SEEDS = SeedCount(seeds=range(59), at_least=55, bar=0.9, bad=(8, 60), good=(0, 180))


# the same runs: a run that reached 0.95 and later fell below 0.8 (a late dip) in sweeps of the
# shipped settings: 8 of 120 before ppo.max_update_kl, 0 of 180 with it (docs/learning.md). So at
# least 58 of the 59 must stay at or above 0.8 once at 0.95 (score 1 = no late dip).
TINY_CPU_NO_LATE_DIP = SeedCount(seeds=range(59), at_least=58, bar=1.0, bad=(8, 120), good=(0, 180))


def no_late_dip(rows: list[dict], high: float = 0.95, low: float = 0.8) -> float:
    """1.0 when the reward never falls below ``low`` after first reaching ``high``, else 0.0."""
    reward = [r["rollout/reward_mean"] for r in rows]
    reached = next((i for i, v in enumerate(reward) if v >= high), len(reward))
    return float(all(v >= low for v in reward[reached:]))


@pytest.mark.slow  # 59 runs of ~22 s, two at a time: ~11 min on 2 cores
def test_tiny_cpu_default_learns(tmp_path):
    """The main job as shipped learns from chance to >= 0.9 on (nearly) every seed, and a run
    that has learnt keeps it: counts over 59 seeds, chosen from the measured rates
    (tests/recipes/seeds.py)."""
    runs = tiny_cpu_seeds(tmp_path, TINY_CPU_SEEDS.seeds, *SHIPPED)
    assert all(rows[0]["rollout/reward_mean"] < 0.1 for rows in runs.values())
    check_seed_count(last_5(runs), TINY_CPU_SEEDS, "tiny_cpu, mean reward of the last 5 steps")
    no_dip = {seed: no_late_dip(rows) for seed, rows in runs.items()}
    check_seed_count(no_dip, TINY_CPU_NO_LATE_DIP, "tiny_cpu, no fall below 0.8 after 0.95")


def test_output_dir_belongs_to_one_run(tmp_path):
    """A fresh run into a used folder is refused with one line and leaves it as it was; a second
    run while the first is alive is refused; resuming the folder is allowed."""
    out = tmp_path / "run"
    args = ["run", "async_ppo", "--config", "tiny_cpu", *FAST, f"output_dir={out}"]
    assert cli(*args, "total_steps=2").returncode == 0
    before = (out / "metrics.jsonl").read_text()
    again = minippo_here(*args, "total_steps=2")
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    assert "holds another run's outputs" in again.stderr and "resume_from=latest" in again.stderr
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"

    # a live run holds the folder: a second one (resuming it) is refused while it runs
    first = subprocess.Popen(
        [sys.executable, "-m", "minippo._cli.main", *args, "total_steps=400", "resume_from=latest"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while (out / "metrics.jsonl").read_text() == before and time.time() < deadline:
            time.sleep(0.2)  # until the first run has logged a step of its own
        second = minippo_here(*args, "total_steps=400", "resume_from=latest")
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another run (pid {first.pid} " in second.stderr
    finally:
        first.kill()
        first.wait(timeout=30)


# tiny_cpu with rollout.sync_every=3: seeds whose final reward stays below 0.9 in a 20-seed sweep
# (benchmarks/learning_sweep.py, 2-core AMD EPYC, torch 2.13.0): 0 of 20 (lowest 0.973; 0.979 at
# lr 3e-3). Its rate before the fix was not measured, so the count catches a run that has
# stopped learning (tests/recipes/seeds.py).
SYNC_EVERY_3_SEEDS = SeedCount(seeds=range(10), at_least=8, bar=0.9, bad=(9, 10), good=(0, 20))


@pytest.mark.slow  # 10 x 60 steps, two at a time; the anchors and the resume inside a cycle run by default
def test_tiny_cpu_sync_every_3_learns(tmp_path):
    """Weights reach the engine every 3 steps (versions count publishes): the run still learns
    to >= 0.9 on (nearly) every seed, a count over seeds (tests/recipes/seeds.py)."""
    runs = tiny_cpu_seeds(tmp_path, SYNC_EVERY_3_SEEDS.seeds, "rollout.sync_every=3", *SHIPPED)
    for rows in runs.values():
        assert [r["correction/anchor_version"] for r in rows[:7]] == [0, 0, 0, 1, 1, 1, 2]
        assert max(r["rollout/staleness_max"] for r in rows) <= 1  # in versions
    check_seed_count(
        last_5(runs), SYNC_EVERY_3_SEEDS, "sync_every=3, mean reward of the last 5 steps"
    )
