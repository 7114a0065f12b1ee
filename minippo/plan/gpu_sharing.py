"""An SGLang engine on the trainer's own GPU: which ``rollout.mode`` a config may run, and the cap
of the trainer's allocator when both hold the GPU at once.

SGLang sizes its KV pool as if the memory outside its static fraction were its own headroom (for
its activations and sampling), and any error in its scheduler kills the rank
(docs/sglang_backend.md "Sharing a GPU with the trainer"). So, with an SGLang engine (``engine._component_`` ending in
``SGLangEngine``):

    rollout.mode=alternate   needs engine.memory_mode=sleep: only then does the engine release its
                             weights, KV cache and CUDA graphs while the trainer trains
    rollout.mode=overlap     (also when rollout.mode is absent) refused unless
                             rollout.share_gpu_with_engine=true, and then unless the plan's formula
                             fits the trainer beside the engine's mem_fraction_static; the recipe
                             caps the trainer's allocator at :func:`trainer_memory_fraction`
                             (:func:`minippo.training.placement.cap_trainer_memory`)

Config only: the model is planned from its shape (config.json or a size builder), nothing is
built or allocated. :func:`reserved_vs_live` (for a run that has a GPU) reports what the
trainer's allocator keeps reserved beyond its live tensors when the engine wakes.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

from omegaconf import DictConfig, OmegaConf

from minippo.config import ConfigError
from minippo.plan.config import (
    DEFAULT_GPU_MEM_GIB,
    engine_options,
    plan_from_config,
)
from minippo.plan.formula import ALLOCATOR_SLACK_BYTES, GiB
from minippo.training.placement import rollout_mode, sglang_on_gpu
from minippo.training.preflight import setting

__all__ = [
    "ReservedLive",
    "reserved_vs_live",
    "shared_gpu_problems",
    "trainer_memory_fraction",
]


def _trainer_beside_engine(
    cfg: DictConfig, world_size: int, gpu_mem_bytes: int, gpu_source: str
) -> tuple[int, str | None]:
    """The formula's trainer bytes at its peak in overlap mode (with the 1 GiB allowance for the
    CUDA context and allocator slack), and the problem line when the trainer and the engine's
    static fraction do not fit in ``gpu_mem_bytes`` together (else None)."""
    # under torchrun a node has $LOCAL_WORLD_SIZE of the ranks (HSDP splits over those only)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    per_node = per_node if per_node >= 1 and world_size % per_node == 0 else world_size
    plan = plan_from_config(
        cfg,
        gpu_mem_gib=gpu_mem_bytes / GiB,
        world_size=per_node,
        nnodes=world_size // per_node,
        device="cuda",
    )
    trainer, gpu = plan.formula_trainer_total, gpu_mem_bytes
    fraction = plan.inputs.engine_mem_fraction or 0.0
    engine = int(fraction * gpu)
    if trainer + engine <= gpu:
        return trainer, None
    fix = "set rollout.mode=alternate (with engine.memory_mode=sleep)"
    room = math.floor((gpu - trainer) / gpu * 100) / 100
    if room > 0:
        fix += f", or engine.mem_fraction_static <= {room:.2f}"
    return trainer, (
        f"rollout.share_gpu_with_engine=true, but the trainer does not fit beside the engine: "
        f"trainer {trainer / GiB:.2f} GiB (minippo plan --formula-only, {world_size} rank(s)) + "
        f"engine.mem_fraction_static={fraction} x {gpu / GiB:.2f} GiB ({gpu_source}) = "
        f"{(trainer + engine) / GiB:.2f} GiB > {gpu / GiB:.2f} GiB; {fix}"
    )


def shared_gpu_problems(
    cfg: DictConfig, *, world_size: int = 1, gpu_mem_gib: float | None = None
) -> list[str]:
    """The refusals of the module docstring for ``cfg`` (nothing without an SGLang engine), one
    line each naming the key and the fix. ``world_size``: the ranks the trainer is sharded over
    (1 plans the largest per-rank trainer); ``gpu_mem_gib``: one GPU's memory (None: 80 GiB, the
    plan's default; :func:`trainer_memory_fraction` checks again against the real GPU)."""
    if not sglang_on_gpu(cfg):
        return []
    try:
        mode = rollout_mode(cfg)
        if mode == "alternate":
            memory_mode = engine_options(cfg)[1].get("memory_mode")
            if memory_mode == "sleep":
                return []
            return [
                f"rollout.mode=alternate with an SGLang engine needs engine.memory_mode=sleep "
                f"(now {memory_mode}): only then does the engine release its weights and KV "
                "cache while the trainer trains; set engine.memory_mode=sleep"
            ]
        if setting(cfg, "rollout.share_gpu_with_engine") is not True:
            absent = OmegaConf.select(cfg, "rollout.mode", default=None) is None
            return [
                "rollout.mode=overlap"
                + (" (the default when rollout.mode is absent)" if absent else "")
                + " generates with SGLang on the trainer's GPU while it trains: the two compete "
                "for memory and an engine OOM kills the rank (docs/sglang_backend.md, 'Sharing a GPU'); set "
                "rollout.mode=alternate and engine.memory_mode=sleep, or "
                "rollout.share_gpu_with_engine=true to share the GPU anyway"
            ]
        gpu = DEFAULT_GPU_MEM_GIB if gpu_mem_gib is None else gpu_mem_gib
        source = "the plan's default GPU" if gpu_mem_gib is None else "gpu_mem_gib"
        _, problem = _trainer_beside_engine(cfg, world_size, int(gpu * GiB), source)
    except ConfigError as e:
        return [str(e)]
    return [] if problem is None else [problem]


def trainer_memory_fraction(
    cfg: DictConfig, *, world_size: int = 1, gpu_mem_bytes: int | None = None
) -> float:
    """The share of the GPU the trainer's caching allocator may hold beside an SGLang engine in
    ``rollout.mode=overlap`` with ``rollout.share_gpu_with_engine=true``: for
    ``torch.cuda.set_per_process_memory_fraction``.

    It is the plan formula's trainer total at its peak (``minippo plan --formula-only``, with its
    1 GiB allowance for the CUDA context and allocator slack) over the GPU's memory: the trainer
    gets what its plan says and no more, and what lies beyond the engine's static fraction and
    this cap stays free for the engine's own activations (SGLang's headroom,
    docs/sglang_backend.md "Sharing a GPU"). A trainer that needs more stops with torch's OutOfMemoryError in
    its own process instead of taking memory the engine counts on.

    ``world_size``: the ranks the trainer is sharded over; ``gpu_mem_bytes``: the GPU's memory
    (None: ``torch.cuda``'s current device). Raises ConfigError, with the figures and the fix,
    when the trainer and the engine's ``mem_fraction_static`` do not fit in it together.
    """
    source = "gpu_mem_bytes"
    if gpu_mem_bytes is None:
        import torch

        gpu_mem_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        source = "this GPU"
    trainer, problem = _trainer_beside_engine(cfg, world_size, int(gpu_mem_bytes), source)
    if problem is not None:
        raise ConfigError(problem)
    return trainer / gpu_mem_bytes


class ReservedLive(NamedTuple):
    """The trainer's CUDA caching allocator after ``torch.cuda.empty_cache()``.

    Fields:
        reserved:  ``torch.cuda.memory_reserved(device)``: bytes the allocator holds from the GPU
        allocated: ``torch.cuda.memory_allocated(device)``: bytes of live tensors
        margin:    the bytes reserved may exceed allocated by (``ALLOCATOR_SLACK_BYTES``, the
                   plan's allowance for allocator slack; docs/memory.md)
    """

    reserved: int
    allocated: int
    margin: int = ALLOCATOR_SLACK_BYTES

    @property
    def slack(self) -> int:
        """Reserved bytes that hold no live tensor (partly used segments)."""
        return self.reserved - self.allocated

    @property
    def within_margin(self) -> bool:
        return self.slack <= self.margin

    def line(self) -> str:
        """One line for a log: the three figures in GiB and the verdict."""
        verdict = "within" if self.within_margin else "OVER"
        return (
            f"trainer allocator after empty_cache: reserved {self.reserved / GiB:.2f} GiB, live "
            f"{self.allocated / GiB:.2f} GiB, slack {self.slack / GiB:.2f} GiB ({verdict} the "
            f"plan's {self.margin / GiB:.2f} GiB)"
        )


def reserved_vs_live(device: Any = None) -> ReservedLive | None:
    """Run ``torch.cuda.empty_cache()`` and report the trainer's reserved and live bytes on
    ``device`` (None: the current CUDA device): what an engine waking on this GPU cannot have.
    None where ``device`` is not a CUDA device or torch has no CUDA (CPU runs)."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return ReservedLive(
        reserved=int(torch.cuda.memory_reserved(device)),
        allocated=int(torch.cuda.memory_allocated(device)),
    )
