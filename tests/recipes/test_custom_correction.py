"""A correction defined outside the package: a user's module on PYTHONPATH, named by
``correction._component_``, goes through the fail-fast contract, ``minippo validate`` and a real
``minippo run`` of the tiny recipe; the contract reads what the class declares."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from minippo.rl.correction import (
    EWMA,
    WeightCopies,
    build_correction,
    correction_class,
    validate_async_off_policy_correction,
)
from minippo.training.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
MODULE = "my_corrections_for_tests"
USER_MODULE = textwrap.dedent(
    '''
    """A user's corrections, outside minippo."""

    import torch

    from minippo.rl.correction import Correction, FixedAnchors, discrepancy_weights

    CALLS = {"check": 0}


    class MuAnchorIS(Correction):
        """anchor = the engine's logprobs μ, weight min(π_θk / μ, cap) from one forward of the
        step-start weights."""

        def __init__(self, *, cap: float = 3.0, **provided):
            super().__init__(cap=cap, **provided)
            self.cap = float(cap)

        @classmethod
        def check(cls, **options):
            CALLS["check"] += 1
            o = super().check(**options)
            if o["cap"] <= 1:
                raise ValueError(f"correction.cap must be > 1 for MuAnchorIS, got cap={o['cap']}")
            return o

        @classmethod
        def stored_weights(cls, *, max_staleness, partial_rollout, **options):
            return []

        @classmethod
        def scoring_passes(cls, *, max_staleness, **options):
            return 1

        def compute(self, batch, actor, step):
            mu = batch.rollout_logprobs.float()
            w = discrepancy_weights(self.score(actor, batch), mu, batch.response_mask, cap=self.cap)
            out = FixedAnchors.from_weights(batch, torch.where(batch.response_mask > 0, mu, 0.0), w)
            out.info["correction/mu_anchor_is_steps"] = float(step + 1)
            return out


    class CurrentWeights(Correction):
        """anchor = the current weights (no behaviour-policy correction)."""

        corrects_behaviour_policy = False

        @classmethod
        def stored_weights(cls, *, max_staleness, partial_rollout, **options):
            return []

        @classmethod
        def scoring_passes(cls, *, max_staleness, **options):
            return 1

        def compute(self, batch, actor, step):
            anchor = self.score(actor, batch)
            w = discrepancy_weights(anchor, batch.rollout_logprobs.float(), batch.response_mask,
                                    cap=None)
            return FixedAnchors.from_weights(batch, anchor, w)
    '''
)
SMALL = [
    "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=8",
    "progress_bar=false",
    "checkpoint.export_hf=false",
    "engine.in_process=true",
]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes the user's module to a temporary folder outside the repository; puts it on
    sys.path (in process) and returns the environment of a subprocess that finds it."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop(MODULE, None)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    yield env
    sys.modules.pop(MODULE, None)


def run_cfg(correction, *, max_staleness=1, estimator="gae"):
    return OmegaConf.create(
        {
            "rollout": {"max_staleness": max_staleness},
            "advantage_estimator": estimator,
            "correction": correction,
        }
    )


def cli(env, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "minippo._cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def test_user_class_passes_the_contract_and_builds(user_module):
    component = f"{MODULE}.MuAnchorIS"
    cls = correction_class(component)
    assert cls.__module__ == MODULE and cls.method == "MuAnchorIS"
    assert cls.summary.startswith("anchor = the engine's logprobs μ, weight min(π_θk / μ, cap)")
    assert validate_async_off_policy_correction(run_cfg({"_component_": component})) == "MuAnchorIS"
    corr = build_correction(
        run_cfg({"_component_": component, "cap": 4.0}, max_staleness=2),
        temperature=0.7,
        updates_per_step=4,
    )
    assert type(corr) is cls and (corr.cap, corr.max_staleness, corr.temperature) == (4.0, 2, 0.7)
    assert cls.scoring_passes(max_staleness=2) == 1
    assert cls.stored_weights(max_staleness=2, partial_rollout=False) == []


def test_options_are_checked_by_the_class(user_module):
    calls = __import__(MODULE).CALLS
    before = calls["check"]
    with pytest.raises(ValueError, match=r"correction.cap must be > 1 for MuAnchorIS, got cap=0.5"):
        validate_async_off_policy_correction(
            run_cfg({"_component_": f"{MODULE}.MuAnchorIS", "cap": 0.5})
        )
    with pytest.raises(ValueError, match=r"got cap=1.0"):  # the constructor runs the same check
        correction_class(f"{MODULE}.MuAnchorIS")(cap=1.0)
    assert calls["check"] == before + 2
    with pytest.raises(ValueError, match=r"MuAnchorIS does not take level='token'; its options"):
        validate_async_off_policy_correction(
            run_cfg({"_component_": f"{MODULE}.MuAnchorIS", "level": "token"})
        )
    # a built-in class's own rule: EWMA's mask [1/c, c] needs c > 1
    with pytest.raises(ValueError, match=r"cap \(c\) must be > 1 .* got cap=1.0"):
        validate_async_off_policy_correction(
            run_cfg({"_component_": "minippo.rl.correction.EWMA", "cap": 1.0})
        )
    with pytest.raises(ValueError, match=r"got cap=0.9"):
        EWMA(cap=0.9)
    assert EWMA.stored_weights(max_staleness=1, partial_rollout=False)[0] == WeightCopies(
        "θ̄", 1, "float32", "accelerator"
    )


def test_contract_reads_corrects_behaviour_policy(user_module):
    node = {"_component_": f"{MODULE}.CurrentWeights"}
    with pytest.raises(ValueError) as e:  # async with a critic
        validate_async_off_policy_correction(run_cfg(node))
    msg = str(e.value)
    assert "Async PPO with a critic" in msg and "correction is 'CurrentWeights'" in msg
    assert (
        "correction._component_=minippo.rl.correction.KeepOldActor\n      keep_old_actor: " in msg
    )
    with pytest.warns(UserWarning, match="Critic-free async run"):
        validate_async_off_policy_correction(run_cfg(node, estimator="grpo"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_async_off_policy_correction(run_cfg(node, max_staleness=0))


def test_user_correction_runs_through_the_cli(user_module, tmp_path):
    component = f"correction._component_={MODULE}.MuAnchorIS"
    overrides = [component, "~correction.reset_below", "correction.cap=3.0"]
    proc = cli(user_module, "validate", "--config", "tiny_cpu", *overrides)
    assert proc.returncode == 0 and "Config is well-formed!" in proc.stdout, proc.stderr[-3000:]
    proc = cli(user_module, "validate", "--config", "tiny_cpu", *overrides, "correction.cap=0.5")
    assert proc.returncode == 1 and "must be > 1 for MuAnchorIS, got cap=0.5" in proc.stderr

    out = tmp_path / "run"
    args = ["run", "async_ppo", "--config", "tiny_cpu", "total_steps=3", f"output_dir={out}"]
    proc = cli(user_module, *args, *SMALL, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["correction/mu_anchor_is_steps"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["correction/forward_passes"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["correction/abs_diff_mean"] for r in rows] == [0.0, 0.0, 0.0]  # the anchor is μ
    assert all(0 < r["correction/is_weight_max"] <= 3.0 for r in rows)
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
