"""Will a run fit? The per-rank memory plan of a run config (``minippo plan``).

Two ways to the same question:

- the formulas (:mod:`minippo.plan.formula`): every item (parameters, gradients, optimizer
  states, activations, correction, no-grad passes, engine) from shapes, with the switches that
  shrink the biggest; nothing is allocated;
- the measured step (:mod:`minippo.plan.measured`): one recipe step of the configured models
  under ``FakeTensorMode`` with torch's ``MemTracker``, the peak of live tensor bytes.

:mod:`minippo.plan.config` reads a run config into the plan's inputs, asking the components it
names (correction class, engine class, advantage estimator) for what the config leaves out.
``rollout.mode`` decides the phases: in ``overlap`` the engine's share and the trainer's peak are
counted at once; in ``alternate`` generation (engine + the trainer's resident state) and training
(the trainer's peak, the engine asleep) take turns, and the verdict is on the larger.
docs/memory.md compares both with measured peaks.

:mod:`minippo.plan.gpu_sharing` holds the preflight refusals for an SGLang engine on the
trainer's GPU (:func:`shared_gpu_problems`) and the trainer's allocator cap when both share it at
once (:func:`trainer_memory_fraction`), and what the trainer's allocator keeps reserved beyond
its live bytes when the engine wakes (:func:`reserved_vs_live`).
"""

from minippo.plan.config import (
    correction_cost,
    engine_options,
    plan_from_config,
    plan_inputs_from_config,
)
from minippo.plan.formula import (
    ActivationBytes,
    CorrectionCost,
    GiB,
    MemoryPlan,
    PlanInputs,
    PlanItem,
    TorchEngineShape,
    activation_bytes,
    block_saved_bytes_per_token,
    model_param_shapes,
    plan_memory,
    scoring_bytes,
    torch_engine_bytes,
)
from minippo.plan.gpu_sharing import (
    ReservedLive,
    reserved_vs_live,
    shared_gpu_problems,
    trainer_memory_fraction,
)
from minippo.plan.measured import MeasuredPeak, measure_from_config, measure_step
from minippo.training.placement import cap_trainer_memory, rollout_mode, sglang_on_gpu

__all__ = [
    "ActivationBytes",
    "CorrectionCost",
    "GiB",
    "MeasuredPeak",
    "MemoryPlan",
    "PlanInputs",
    "PlanItem",
    "ReservedLive",
    "TorchEngineShape",
    "activation_bytes",
    "block_saved_bytes_per_token",
    "cap_trainer_memory",
    "correction_cost",
    "engine_options",
    "measure_from_config",
    "measure_step",
    "model_param_shapes",
    "plan_from_config",
    "plan_inputs_from_config",
    "plan_memory",
    "reserved_vs_live",
    "rollout_mode",
    "scoring_bytes",
    "sglang_on_gpu",
    "shared_gpu_problems",
    "torch_engine_bytes",
    "trainer_memory_fraction",
]
