"""The fail-fast contract: validate_async_off_policy_correction(cfg) on whole-run configs."""

import subprocess
import sys
import warnings

import pytest
from omegaconf import OmegaConf

import minippo.rl.correction as correction
from minippo.rl.correction import (
    EWMA,
    TIS,
    KeepOldActor,
    LogLinearProx,
    NoCorrection,
    RolloutLogprobs,
    WeightCopies,
    build_correction,
    correction_class,
    validate_async_off_policy_correction,
)

P = "minippo.rl.correction."


def run_cfg(correction=None, *, max_staleness=2, partial_rollout=False, estimator="gae", **extra):
    cfg = {
        "rollout": {"max_staleness": max_staleness, "partial_rollout": partial_rollout},
        "advantage_estimator": estimator,
        "ppo": {"epochs": 2, "minibatches": 4},
        # building either of these would fail: the check must never touch them
        "model": {"_component_": "no_such_package.build_model"},
        "engine": {"_component_": "no_such_package.Engine"},
        **extra,
    }
    if correction is not None:
        cfg["correction"] = correction
    return OmegaConf.create(cfg)


@pytest.mark.parametrize("correction", [None, {"_component_": P + "NoCorrection"}])
@pytest.mark.parametrize(
    "async_kind", [{"max_staleness": 1}, {"max_staleness": 0, "partial_rollout": True}]
)
def test_async_ppo_with_critic_needs_a_correction(correction, async_kind):
    with pytest.raises(ValueError) as e:
        validate_async_off_policy_correction(run_cfg(correction, **async_kind))
    msg = str(e.value)
    assert "Async PPO with a critic" in msg and "advantage_estimator=gae" in msg
    for method, cls in [
        ("rollout_logprobs", "RolloutLogprobs"),
        ("tis", "TIS"),
        ("keep_old_actor", "KeepOldActor"),
        ("ewma", "EWMA"),
    ]:
        # the exact key=value to set, and one line on what it does
        assert f"correction._component_={P}{cls}\n      {method}: " in msg


def test_error_fires_before_anything_is_built():
    # model/engine components point at a package that does not exist; only the correction error
    # comes out, and nothing of minippo.models or minippo.engine is imported by the check
    code = (
        "import sys\n"
        "from omegaconf import OmegaConf\n"
        "from minippo.rl.correction import validate_async_off_policy_correction as v\n"
        "cfg = OmegaConf.create({'rollout': {'max_staleness': 1}, 'advantage_estimator': 'gae',"
        " 'model': {'_component_': 'no_such_package.build'},"
        " 'engine': {'_component_': 'no_such_package.Engine'}})\n"
        "try:\n"
        "    v(cfg)\n"
        "except ValueError as e:\n"
        "    assert 'needs an explicit behaviour-policy correction' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "bad = [m for m in ('minippo.models', 'minippo.engine', 'no_such_package') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "import torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("component", ["RolloutLogprobs", "TIS", "KeepOldActor", "EWMA"])
def test_each_method_passes_async_with_critic(component):
    method = validate_async_off_policy_correction(run_cfg({"_component_": P + component}))
    assert method == getattr(correction, component).method


def test_loglinear_prox_passes():
    assert validate_async_off_policy_correction(run_cfg({"_component_": P + "LogLinearProx"})) == (
        "loglinear_prox"
    )


def test_critic_free_async_none_warns():
    with pytest.warns(UserWarning, match="Critic-free async run"):
        assert validate_async_off_policy_correction(run_cfg(None, estimator="grpo")) == "none"


def test_synchronous_passes_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_async_off_policy_correction(run_cfg(None, max_staleness=0)) == "none"
        validate_async_off_policy_correction(
            run_cfg({"_component_": P + "NoCorrection"}, max_staleness=0)
        )


def test_only_gae_counts_as_critic():
    with pytest.warns(UserWarning, match="advantage_estimator=rloo"):
        validate_async_off_policy_correction(run_cfg(None, estimator="rloo"))


@pytest.mark.parametrize(
    "correction, match",
    [
        (
            {"_component_": P + "RolloutLogprobs", "cap": 3.0},
            r"incompatible with tis options \(cap=3\.0\)",
        ),
        ({"_component_": P + "RolloutLogprobs", "level": "token"}, r"level='token'"),
        ({"_component_": P + "TIS", "cap": 0}, r"cap must be >= 1 .*got cap=0"),
        ({"_component_": P + "TIS", "cap": -1.0}, r"cap=-1\.0"),
        ({"_component_": P + "TIS", "cap": 0.9}, r"cap must be >= 1 .*got cap=0\.9"),
        ({"_component_": P + "TIS", "low": 1.5, "cap": 3.0}, r"low must be in \[0, 1\]"),
        ({"_component_": P + "TIS", "low": -0.1}, r"low must be in \[0, 1\]"),
        (
            {"_component_": P + "TIS", "low": 1.0, "cap": 1.0},
            r"low \(1\.0\) must be < cap \(1\.0\)",
        ),
        ({"_component_": P + "LogLinearProx", "cap": 0.5}, r"cap must be >= 1 .*got cap=0\.5"),
        ({"_component_": P + "TIS", "level": "batch"}, r"level='batch' is not one of"),
        ({"_component_": P + "TIS", "mode": "clip"}, r"mode='clip' is not one of"),
        ({"_component_": P + "EWMA", "beta": 1.0}, r"beta must be in \(0, 1\), got beta=1\.0"),
        ({"_component_": P + "EWMA", "beta": 0}, r"beta=0"),
        ({"_component_": P + "EWMA", "reset_below": 1.2}, r"reset_below=1\.2"),
        ({"_component_": P + "EWMA", "reset_below": 0.0}, r"reset_below=0\.0"),
        ({"_component_": P + "EWMA", "cap": 0.5}, r"cap=0\.5"),
        ({"_component_": P + "EWMA", "swap_storage": "disk"}, r"swap_storage='disk'"),
        ({"_component_": P + "KeepOldActor", "cap": 0}, r"cap=0"),
        ({"_component_": P + "KeepOldActor", "cap": 0.8}, r"cap must be >= 1"),
        ({"_component_": P + "KeepOldActor", "storage": "disk"}, r"storage='disk'"),
        ({"_component_": P + "KeepOldActor", "storage_dtype": "int8"}, r"storage_dtype='int8'"),
        ({"_component_": P + "LogLinearProx", "cap": -2}, r"cap=-2"),
        (
            {"_component_": P + "EWMA", "max_staleness": 5},
            r"contradicts rollout.max_staleness \(2\)",
        ),
        ({"_component_": P + "Bogus"}, r"'minippo.rl.correction' has no 'Bogus'"),
        ({"_component_": "no_such_package.Correction"}, r"no module named 'no_such_package'"),
        ({"_component_": "collections.OrderedDict"}, r"is not a subclass of .*Correction"),
        ({"_component_": P + "TIS", "temperature": 0.5}, r"correction.temperature is set by"),
        ({"_component_": P + "EWMA", "updates_per_step": 4}, r"drop correction.updates_per_step"),
        ({"cap": 2.0}, r"no _component_ key"),
    ],
)
def test_contradictory_options_rejected(correction, match):
    with pytest.raises(ValueError, match=match):
        validate_async_off_policy_correction(run_cfg(correction))


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"max_staleness": None}, r"rollout.max_staleness must be an int >= 0"),
        ({"max_staleness": -1}, r"got -1"),
        ({"partial_rollout": "yes"}, r"partial_rollout must be true or false"),
        ({"estimator": None}, r"advantage_estimator must be set"),
    ],
)
def test_run_keys_checked(bad, match):
    kw = {"max_staleness": 1, "estimator": "gae", **bad}
    cfg = run_cfg({"_component_": P + "EWMA"}, **kw)
    with pytest.raises(ValueError, match=match):
        validate_async_off_policy_correction(cfg)


def test_constructors_share_the_checks():
    with pytest.raises(ValueError, match=r"low \(3\.0\) must be < cap \(2\.0\)"):
        TIS(low=3.0)
    with pytest.raises(ValueError, match="reset_below"):
        EWMA(reset_below=1.0)
    with pytest.raises(ValueError, match="updates_per_step"):
        EWMA(updates_per_step=0)


def test_build_correction_from_yaml_scheme():
    cfg = run_cfg({"_component_": P + "EWMA", "reset_below": 0.7})
    corr = build_correction(cfg, temperature=0.9, updates_per_step=8)
    assert isinstance(corr, EWMA)
    assert (corr.reset_below, corr.temperature, corr.max_staleness) == (0.7, 0.9, 2)
    assert corr.beta == pytest.approx(8 / 9)  # s = 2 × 8 / 2
    corr = build_correction(
        run_cfg({"_component_": P + "KeepOldActor", "storage_dtype": "bf16", "cap": None}),
        temperature=1.0,
        updates_per_step=1,
    )
    assert isinstance(corr, KeepOldActor) and corr.cap is None
    assert isinstance(
        build_correction(run_cfg(None), temperature=1.0, updates_per_step=1), NoCorrection
    )


CLASSES = (RolloutLogprobs, TIS, KeepOldActor, EWMA, LogLinearProx, NoCorrection)


def test_method_names_and_components():
    assert [c.method for c in CLASSES] == [
        "rollout_logprobs",
        "tis",
        "keep_old_actor",
        "ewma",
        "loglinear_prox",
        "none",
    ]
    for cls in CLASSES:  # the documented dotpaths, and the modules that define the classes
        assert correction_class(P + cls.__name__) is cls
        assert correction_class(f"{cls.__module__}.{cls.__name__}") is cls
        assert cls.summary and "\n" not in cls.summary  # one line for the fail-fast message
    assert [c.corrects_behaviour_policy for c in CLASSES] == [True] * 5 + [False]


def test_declared_costs():
    # extra forwards per step, worst case: keep_old_actor one per version of the staleness window,
    # ewma two on a reset step
    passes = [c.scoring_passes(max_staleness=3) for c in CLASSES]
    assert passes == [0, 1, 4, 2, 0, 1]
    for cls in (RolloutLogprobs, TIS, LogLinearProx, NoCorrection):
        assert cls.stored_weights(max_staleness=3, partial_rollout=True) == []
    # ewma: fp32 θ̄ on the device + a swap buffer (master dtype) where swap_storage says
    assert EWMA.stored_weights(max_staleness=3, partial_rollout=False) == [
        WeightCopies("θ̄", 1, "float32", "accelerator"),
        WeightCopies("swap buffer", 1, None, "accelerator"),
    ]
    assert EWMA.stored_weights(max_staleness=3, partial_rollout=False, swap_storage="cpu")[1] == (
        WeightCopies("swap buffer", 1, None, "cpu")
    )
    # keep_old_actor: max_staleness + 1 (+ 1 with partial rollouts) snapshots + a swap buffer
    koa = KeepOldActor.stored_weights(max_staleness=3, partial_rollout=True, storage_dtype="bf16")
    assert koa == [
        WeightCopies("snapshots", 5, "bfloat16", "cpu"),
        WeightCopies("swap buffer", 1, None, "cpu"),
    ]
    koa = KeepOldActor.stored_weights(max_staleness=1, partial_rollout=False, storage="accelerator")
    assert koa[0] == WeightCopies("snapshots", 2, None, "accelerator")
    with pytest.raises(ValueError, match=r"storage='disk'"):  # the options are checked
        KeepOldActor.stored_weights(max_staleness=1, partial_rollout=False, storage="disk")


def test_check_fills_the_class_defaults():
    assert EWMA.check(cap=3.0)["reset_below"] == 0.8
    assert TIS.check()["level"] == "token"
    with pytest.raises(ValueError, match=r"correction NoCorrection does not take cap=2\.0"):
        NoCorrection.check(cap=2.0)
