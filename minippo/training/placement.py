"""A run's decisions about where its parts run, read from its config: which schedule generates
(``rollout.mode``), whether the engine holds a GPU (:func:`sglang_on_gpu`), and how much of that
GPU the trainer's allocator may hold (:func:`cap_trainer_memory`).

The recipe and ``minippo plan`` (:mod:`minippo.plan`) call these same functions, so the plan
describes the run the recipe starts. Only :func:`cap_trainer_memory` needs the plan's formulas,
and only when an SGLang engine generates on the trainer's GPU while it trains.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from minippo.config import ConfigError

ROLLOUT_MODES = ("alternate", "overlap")  # as minippo.plan.formula.ROLLOUT_MODES

__all__ = ["ROLLOUT_MODES", "cap_trainer_memory", "rollout_mode", "sglang_on_gpu"]


def rollout_mode(cfg: DictConfig) -> str:
    """``rollout.mode``: "alternate" or "overlap" (the recipe's default when the key is absent)."""
    mode = OmegaConf.select(cfg, "rollout.mode", default=None)
    mode = "overlap" if mode is None else str(mode)
    if mode not in ROLLOUT_MODES:
        raise ConfigError(f"rollout.mode={mode!r} must be one of {', '.join(ROLLOUT_MODES)}")
    return mode


def sglang_on_gpu(cfg: DictConfig) -> bool:
    """Whether ``engine._component_`` names the SGLang backend on a GPU (``engine.device`` other
    than "cpu": an SGLang engine on the CPU shares no GPU with the trainer)."""
    component = OmegaConf.select(cfg, "engine._component_", default=None)
    on_cpu = OmegaConf.select(cfg, "engine.device", default="cuda") == "cpu"
    return isinstance(component, str) and component.endswith("SGLangEngine") and not on_cpu


def cap_trainer_memory(cfg: DictConfig, device: Any, *, world_size: int = 1) -> None:
    """With an SGLang engine on the trainer's GPU ``device`` in ``rollout.mode=overlap`` (allowed
    only with ``rollout.share_gpu_with_engine``), cap this process's CUDA allocator at
    :func:`minippo.plan.trainer_memory_fraction` (the plan formula's trainer peak over the GPU's
    memory); otherwise (another device, engine or mode) do nothing."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and sglang_on_gpu(cfg) and rollout_mode(cfg) == "overlap":
        from minippo.plan.gpu_sharing import trainer_memory_fraction

        fraction = trainer_memory_fraction(cfg, world_size=world_size)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
