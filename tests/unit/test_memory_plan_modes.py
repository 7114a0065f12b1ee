"""The memory plan per ``rollout.mode``, and the preflight refusals for an SGLang engine on the
trainer's GPU (``minippo.plan.gpu_sharing``).

alternate: two phases that take turns, the verdict on the larger: generation (the engine's share
+ what the trainer keeps on the device between steps, less the actor's and critic's parameters
and optimizer states with ``rollout.offload_trainer``) and training (the trainer's peak; the
engine has released its memory). overlap: the engine's share and the trainer's peak at once.
Every expected figure below is a sum of the plan's own items, named one by one.

The shipped GPU configs are planned from their size builders (no download), on 80 GiB GPUs.
"""

import math
from pathlib import Path

import pytest

from minippo.config import ConfigError, load_config
from minippo.plan import (
    GiB,
    MeasuredPeak,
    plan_from_config,
    shared_gpu_problems,
    trainer_memory_fraction,
)
from minippo.plan.formula import ENGINE_AFTER_RELEASE_BYTES
from minippo.training.preflight import ASYNC_PPO_SCHEMA, config_problems

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {  # config -> (size builder standing in for its HF folder, ranks)
    "qwen3_4b_dapo_math_8gpu": ("minippo.models.qwen3_4b", 8),
    "qwen3_0_6b_gsm8k_1gpu": ("minippo.models.qwen3_0_6b", 1),
}
GPU = 80 * GiB


def _cfg(name, *over):
    if not (REPO / "configs" / f"{name}.yaml").exists():
        pytest.skip(f"configs/{name}.yaml is not in this checkout")
    builder = SHIPPED[name][0]
    return load_config(name, ["checkpoint_path=null", f"model={{_component_: {builder}}}", *over])


def _plan(name, *over):
    return plan_from_config(_cfg(name, *over), gpu_mem_gib=80, world_size=SHIPPED[name][1])


def _item(plan, name):
    return next(i for i in plan.items if i.name == name)


def _offloadable(plan) -> int:
    """The actor's and critic's parameters and optimizer states on the device."""
    models = ["actor"] + (["critic"] if plan.inputs.critic is not None else [])
    return sum(
        _item(plan, f"{m} {what}").device
        for m in models
        for what in ("parameters", "optimizer states")
    )


# kl.coef > 0 adds the frozen reference, which stays on the device while the engine generates
@pytest.mark.parametrize(
    "name,over",
    [("qwen3_4b_dapo_math_8gpu", ()), ("qwen3_0_6b_gsm8k_1gpu", ("kl.coef=0.01",))],
)
def test_alternate_mode_budgets_generation_and_training_as_two_phases(name, over):
    alt = _plan(name, "rollout.mode=alternate", "rollout.offload_trainer=false", *over)
    overlap = _plan(name, "rollout.mode=overlap", *over)
    engine = _item(alt, "engine (mem_fraction)").device
    assert engine == int(alt.inputs.engine_mem_fraction * GPU) > 0
    correction = next(i for i in alt.items if i.name.startswith("correction"))
    kept = engine + correction.device + _item(alt, "CUDA context + slack").device
    kept += sum(i.device for i in alt.items if i.name == "reference model")
    assert (name == "qwen3_0_6b_gsm8k_1gpu") == any(i.name == "reference model" for i in alt.items)
    # generation: the engine + the trainer's parameters, optimizer states, reference, correction
    # and CUDA context; no gradients (freed at each optimizer step), activations or FSDP working set
    assert alt.generation_total(False) == kept + _offloadable(alt)
    assert alt.generation_total(True) == kept
    assert alt.offloaded == _offloadable(alt)
    # training: the trainer's peak + what the released engine keeps (its process's CUDA context,
    # an estimate)
    after = alt.engine_after_release
    assert after == ENGINE_AFTER_RELEASE_BYTES > 0 and overlap.engine_after_release == 0
    assert alt.training_total == overlap.formula_trainer_total + after
    assert alt.training_total == overlap.training_total - engine + after
    assert alt.device_total == max(alt.training_total, alt.generation_total(False))
    assert alt.fits is (alt.device_total <= GPU)
    # overlap: everything at once, as before
    assert overlap.device_total == overlap.formula_trainer_total + engine
    assert alt.device_total < overlap.device_total
    larger = "generation" if alt.generation_total() > alt.training_total else "training"
    text = alt.table()
    assert f"the larger phase: {larger})" in text
    assert "rollout.mode=alternate, rollout.offload_trainer=false" in text
    row = f"{'  generation, offload_trainer':<30}{alt.generation_total(True) / GiB:>10.2f}"
    assert row in text
    assert "rollout.mode=overlap: engine" in overlap.table()


def test_the_shipped_configs_peak_in_the_phase_their_comments_say():
    big = _plan("qwen3_4b_dapo_math_8gpu")  # as shipped: alternate, no offload
    assert big.inputs.rollout_mode == "alternate" and not big.inputs.offload_trainer
    assert big.generation_total() > big.training_total  # 8 ranks shard the trainer thin
    small = _plan("qwen3_0_6b_gsm8k_1gpu")
    assert small.training_total > small.generation_total()  # activations without AC, one rank
    # offloading shrinks only the generation phase: the 0.6B verdict would not move
    off = _plan("qwen3_0_6b_gsm8k_1gpu", "rollout.offload_trainer=true")
    assert off.device_total == small.device_total
    assert off.host_total == small.host_total + int(small.offloaded * small.pinned_factor)
    assert big.fits and small.fits


def test_offload_trainer_moves_the_generation_phase_to_the_host():
    base = _plan("qwen3_4b_dapo_math_8gpu", "rollout.offload_trainer=false")
    off = _plan("qwen3_4b_dapo_math_8gpu", "rollout.offload_trainer=true")
    assert off.device_total == max(off.training_total, base.generation_total() - base.offloaded)
    assert off.device_total < base.device_total
    assert off.host_total == base.host_total + int(base.offloaded * base.pinned_factor)
    assert any("rollout.offload_trainer=true moves" in a for a in base.advice())
    assert not any("offload_trainer" in a for a in off.advice())


def test_the_mode_decides_not_memory_mode_and_offload_counts_only_in_alternate():
    # rollout.mode absent: overlap, whatever engine.memory_mode says
    absent = _plan("qwen3_0_6b_gsm8k_1gpu", "~rollout.mode")
    assert absent.inputs.rollout_mode == "overlap" and absent.inputs.engine_mem_fraction
    assert absent.device_total == absent.formula_trainer_total + int(0.35 * GPU)
    with_offload = _plan("qwen3_0_6b_gsm8k_1gpu", "~rollout.mode", "rollout.offload_trainer=true")
    assert with_offload.device_total == absent.device_total
    assert with_offload.host_total == absent.host_total
    with pytest.raises(
        ConfigError, match=r"rollout\.mode='both' must be one of alternate, overlap"
    ):
        _plan("qwen3_0_6b_gsm8k_1gpu", "rollout.mode=both")


def test_the_measured_step_gives_the_training_phase_only():
    plan = _plan("qwen3_0_6b_gsm8k_1gpu")
    generation, host = plan.generation_total(), plan.host_total
    peak = 40 * GiB  # a measured peak of the trainer process: device and host together
    plan.measured = MeasuredPeak(peak=peak, by_kind={}, device="cpu", seconds=0.0)
    context = _item(plan, "CUDA context + slack").device
    # the measured peak counts host tensors, not the pinned allocator's rounding of their blocks
    rounding = sum(i.pinned_extra for i in plan.items)
    correction = next(i for i in plan.items if i.name.startswith("correction"))
    assert rounding > 0 and correction.pinned_extra == rounding
    # the engine sleeps while training: only its CUDA context (an estimate) stays
    tensors_on_host = host - rounding
    assert plan.training_total == peak - tensors_on_host + context + ENGINE_AFTER_RELEASE_BYTES
    assert plan.generation_total() == generation  # from the formulas: the step does not generate
    assert plan.device_total == max(plan.training_total, generation)
    assert "training phase from the measured step" in plan.table()


# ------------------------------------------------------------------------------------------------
# Preflight: an SGLang engine on the trainer's GPU


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_gpu_configs_pass_the_shared_gpu_checks(name):
    if not (REPO / "configs" / f"{name}.yaml").exists():
        pytest.skip(f"configs/{name}.yaml is not in this checkout")
    cfg = load_config(name)  # as shipped: alternate mode plans nothing, so no download needed
    assert cfg.rollout.mode == "alternate" and cfg.engine.memory_mode == "sleep"
    assert config_problems(cfg, ASYNC_PPO_SCHEMA, world_size=SHIPPED[name][1]) == []


@pytest.mark.parametrize(
    "over,phrase",
    [
        (
            ["engine.memory_mode=overlap"],
            "rollout.mode=alternate with an SGLang engine needs engine.memory_mode=sleep (now "
            "overlap)",
        ),
        (["~rollout.mode"], "rollout.mode=overlap (the default when rollout.mode is absent)"),
        (["rollout.mode=overlap"], "or rollout.share_gpu_with_engine=true to share the GPU"),
        (
            ["rollout.mode=overlap", "rollout.share_gpu_with_engine=true"],
            "engine.mem_fraction_static=0.5 x 80.00 GiB (the plan's default GPU)",
        ),
    ],
)
def test_config_problems_refuse_an_unsafe_shared_gpu_in_one_line(over, phrase):
    cfg = _cfg("qwen3_0_6b_gsm8k_1gpu", "engine.mem_fraction_static=0.5", *over)
    problems = config_problems(cfg, ASYNC_PPO_SCHEMA)
    assert len(problems) == 1 and phrase in problems[0], problems
    assert "set " in problems[0]  # the fix
    # the recipe's validate_config (minippo run / validate) refuses it with the same line
    validate_config = __import__("runpy").run_path(str(REPO / "recipes" / "async_ppo.py"))[
        "validate_config"
    ]
    with pytest.raises(ConfigError, match=r"rollout\.mode"):
        validate_config(cfg, 1)


def test_overlap_with_a_shared_gpu_needs_the_trainer_to_fit_beside_the_engine():
    share = ["rollout.mode=overlap", "rollout.share_gpu_with_engine=true"]
    # 0.6B on one GPU: the formula's trainer beside 0.35 of 80 GiB fits (the config before
    # alternate mode), beside 0.5 it does not
    fits = _cfg("qwen3_0_6b_gsm8k_1gpu", *share)
    assert shared_gpu_problems(fits) == []
    cfg = _cfg("qwen3_0_6b_gsm8k_1gpu", *share, "engine.mem_fraction_static=0.5")
    trainer = plan_from_config(cfg, gpu_mem_gib=80).formula_trainer_total
    assert trainer + 0.5 * GPU > GPU >= trainer + 0.35 * GPU
    (line,) = shared_gpu_problems(cfg)
    room = math.floor((GPU - trainer) / GPU * 100) / 100
    assert f"trainer {trainer / GiB:.2f} GiB (minippo plan --formula-only, 1 rank(s))" in line
    assert f"= {(trainer + 0.5 * GPU) / GiB:.2f} GiB > 80.00 GiB" in line
    assert line.endswith(
        f"set rollout.mode=alternate (with engine.memory_mode=sleep), or "
        f"engine.mem_fraction_static <= {room:.2f}"
    )
    assert shared_gpu_problems(cfg, gpu_mem_gib=141) == []  # a larger GPU has the room
    # the ranks shard the trainer: 4B fits beside 0.6 of 80 GiB on 8 ranks, not on one, where
    # the trainer alone is larger than the GPU (so only alternate mode is proposed)
    cfg = _cfg("qwen3_4b_dapo_math_8gpu", *share, "engine.mem_fraction_static=0.6")
    assert shared_gpu_problems(cfg, world_size=8) == []
    (line,) = shared_gpu_problems(cfg, world_size=1)
    assert line.endswith("set rollout.mode=alternate (with engine.memory_mode=sleep)")


def test_other_engines_are_not_checked():
    tiny = REPO / "configs" / "tiny_cpu.yaml"
    if not tiny.exists():
        pytest.skip("needs configs/tiny_cpu.yaml")
    for mode in ("alternate", "overlap"):  # TorchEngine: its own process on CPU cores
        assert shared_gpu_problems(load_config(tiny, [f"rollout.mode={mode}"])) == []


def test_trainer_memory_fraction_is_the_planned_trainer_over_the_gpu():
    share = ["rollout.mode=overlap", "rollout.share_gpu_with_engine=true"]
    cfg = _cfg("qwen3_0_6b_gsm8k_1gpu", *share)
    fraction = trainer_memory_fraction(cfg, world_size=1, gpu_mem_bytes=GPU)
    trainer = plan_from_config(cfg, gpu_mem_gib=80).formula_trainer_total
    assert fraction == trainer / GPU
    assert fraction + cfg.engine.mem_fraction_static <= 1
    big = 141 * GiB  # the trainer's bytes do not depend on the GPU: a smaller share of a larger one
    assert trainer_memory_fraction(cfg, gpu_mem_bytes=big) == pytest.approx(trainer / big)
    cfg = _cfg("qwen3_0_6b_gsm8k_1gpu", *share, "engine.mem_fraction_static=0.5")
    with pytest.raises(ConfigError, match=r"does not fit beside the engine.*\(gpu_mem_bytes\)"):
        trainer_memory_fraction(cfg, gpu_mem_bytes=GPU)


def test_the_device_planned_is_where_the_engine_generates():
    """One rule (``sglang_on_gpu``) for the plan and the shared-GPU checks: SGLang on the CPU
    (tiny_sglang_cpu) is planned as a CPU run, SGLang on a GPU as a CUDA one."""
    assert plan_from_config(load_config("tiny_sglang_cpu", [])).inputs.device == "cpu"
    assert plan_from_config(load_config("tiny_cpu", [])).inputs.device == "cpu"
    assert _plan("qwen3_4b_dapo_math_8gpu").inputs.device == "cuda"
