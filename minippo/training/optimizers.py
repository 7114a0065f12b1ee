"""Optimizers a config can name, and the memory their state costs.

A config picks the optimizer as a ``_component_``; the recipe builds it with
``build_optimizer(cfg.optimizer, model.parameters())`` (``instantiate`` with the parameters passed
positionally, so any ``torch.optim``-style class can be named directly)::

    optimizer:                                   # torch AdamW, fused kernel where supported
      _component_: minippo.training.optimizers.AdamW
      lr: 1.0e-6
    optimizer:                                   # 8-bit states (torchao), ~2 bytes per parameter
      _component_: torchao.optim.AdamW8bit
      lr: 1.0e-6
    optimizer:                                   # 4-bit states (torchao), ~1 byte per parameter
      _component_: torchao.optim.AdamW4bit
      lr: 1.0e-6
    optimizer:                                   # states and step on the host (CUDA only)
      _component_: minippo.training.optimizers.CPUOffload
      optimizer: torch.optim.AdamW
      lr: 1.0e-6

Bytes of optimizer state per parameter element (Adam keeps two moments, m and v):

    torch AdamW     2 × element size of the parameter   (fp32 parameters: 8 bytes)
    AdamW8bit       2 × (1 + 4 / 256)  ≈ 2.03 bytes     (uint8 codes + one fp32 scale per block of 256)
    AdamW4bit       2 × (0.5 + 4 / 128) ≈ 1.06 bytes    (two 4-bit codes per byte + fp32 scale per 128)
    CPUOffload      0 on the accelerator for tensors of >= minimal_size elements; on the host:
                    the inner optimizer's states + an fp32 copy of the parameter + its gradient

torchao quantizes only tensors whose *local* element count (the FSDP2 shard on this rank) is at least
4096 and divisible by the block size; smaller tensors keep plain states in the parameter's dtype.
:func:`optimizer_state_bytes` applies exactly these rules; the memory planner uses it.

State from setup: ``build_optimizer`` creates the state of the optimizers above (those of
:data:`OPTIMIZER_SPECS`) at once (:func:`materialize_state`), so that on CUDA it is allocated
beside the parameters, before any activation, instead of inside blocks the caching allocator
cached from the first step's activations (docs/memory.md, "Reserved and live bytes").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from minippo.config import ConfigError, instantiate, locate

__all__ = [
    "OPTIMIZER_SPECS",
    "AdamW",
    "CPUOffload",
    "OptimizerSpec",
    "StateBytes",
    "build_optimizer",
    "materialize_state",
    "optimizer_spec",
    "optimizer_state_bytes",
]

log = logging.getLogger(__name__)

# torchao's rule (``_AdamBase._new_buffer``): quantize only tensors with at least this many local
# elements (and a multiple of the block size).
TORCHAO_MIN_QUANT_NUMEL = 4096


def AdamW(
    params: Iterable[Any],
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the fused kernel whenever every parameter allows it.

    ``fused=None`` picks fused when all parameters are floating point and live on a device type
    with a fused AdamW kernel (CPU and CUDA in current torch; FSDP2 DTensor parameters included);
    ``fused=False`` forces the multi-tensor ``foreach`` path. ``betas`` may come from YAML as a list.
    """
    params = list(params)
    if fused is None:
        fused = _fused_supported(params)
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused
    )


def _fused_supported(params: list[Any]) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(
        t.is_floating_point() and t.device.type in devices for t in tensors
    )


def CPUOffload(
    params: Iterable[Any],
    optimizer: str = "torch.optim.AdamW",
    *,
    offload_gradients: bool = False,
    minimal_size: int = 4096,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer``: states, an fp32 parameter copy and gradients live in pinned
    host memory and the step runs on the CPU, overlapped with the backward pass.

    Args:
        params: the parameters (plain tensors on one CUDA device).
        optimizer: dotted path of the inner optimizer class (``torch.optim.AdamW``,
            ``torchao.optim.AdamW8bit``...); a string so that YAML can name it.
        offload_gradients: free the device gradients once copied to the host (no gradient
            accumulation across micro-batches then).
        minimal_size: tensors with fewer elements stay on the device with an on-device optimizer.
        **optimizer_kwargs: passed to the inner optimizer (lr, weight_decay, betas...).

    Raises:
        RuntimeError: without CUDA/XPU (torchao copies gradients device→host on a side stream and
            asserts an accelerator), or for FSDP2-sharded (DTensor) parameters: torchao documents
            this wrapper for single-device training only.
    """
    has_xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    if not (torch.cuda.is_available() or has_xpu):
        raise RuntimeError(
            "optimizer._component_=minippo.training.optimizers.CPUOffload needs a CUDA (or XPU) "
            "device: torchao.optim.CPUOffloadOptimizer copies gradients device→host on a side "
            "stream and refuses to run otherwise. On a CPU-only machine the optimizer state is "
            "already in host memory: use optimizer._component_=minippo.training.optimizers.AdamW"
        )
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if any(type(t).__name__ == "DTensor" for t in tensors):
        raise RuntimeError(
            "optimizer._component_=minippo.training.optimizers.CPUOffload got FSDP2-sharded "
            "(DTensor) parameters; torchao.optim.CPUOffloadOptimizer is for single-device "
            "training. For sharded runs shrink the states with torchao.optim.AdamW8bit or "
            "torchao.optim.AdamW4bit instead"
        )
    from torchao.optim import CPUOffloadOptimizer

    if "betas" in optimizer_kwargs:
        optimizer_kwargs["betas"] = tuple(optimizer_kwargs["betas"])
    return CPUOffloadOptimizer(
        params,
        locate(optimizer, "optimizer.optimizer"),
        offload_gradients=offload_gradients,
        minimal_size=minimal_size,
        **optimizer_kwargs,
    )


def build_optimizer(node: DictConfig | dict, params: Iterable[Any]) -> torch.optim.Optimizer:
    """Build the optimizer that the config node names, over ``params``.

    ``node`` is a ``_component_`` mapping (see the module docstring); ``params`` an iterable of
    parameters or parameter groups, passed positionally. Unknown components are allowed (any
    ``torch.optim``-style class works); the memory planner only knows those in OPTIMIZER_SPECS.
    """
    params = list(params)
    if not params:
        raise ValueError("build_optimizer got no parameters; is every parameter frozen?")
    if node is None or "_component_" not in node:
        raise ConfigError(
            "optimizer: needs a _component_, e.g. _component_: minippo.training.optimizers.AdamW "
            f"(known: {', '.join(OPTIMIZER_SPECS)})"
        )
    if _cpu_foreach_by_default(node, params):
        optimizer = instantiate(node, params, foreach=True)
    else:
        optimizer = instantiate(node, params)
    component = str(node["_component_"])
    if component in OPTIMIZER_SPECS:
        materialize_state(optimizer)
    elif component != CPU_OFFLOAD:  # CPUOffload keeps its states in pinned host memory
        log.warning(
            "optimizer._component_=%s: its state is created at its first step (state from setup "
            "only for %s); on CUDA that state may be carved from cached activation blocks",
            component,
            ", ".join(OPTIMIZER_SPECS),
        )
    return optimizer


def materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an Adam-family ``optimizer`` (torch Adam/AdamW, torchao's 8-bit, 4-bit
    and fp8 Adam) now, exactly as its first ``step()`` would create it before updating.

    The state is made the way a resume makes it (``get_state_dict`` →
    ``torch.distributed.checkpoint.state_dict._init_optim_state``: one step on zero gradients
    with the learning rate 0, which leaves the parameters bit for bit unchanged), then set back to
    a fresh state: the step counters to 0 and every moment to zero as the optimizer's own
    initialisation makes it (plain tensors zero; torchao's quantized states with zero codes and
    zero scales, the lookup table kept). So training from here gives the same parameters, bit for
    bit, as a lazily created state (tests/unit/test_optimizer_eager_state.py, one process and
    FSDP2 on 2 gloo ranks). A no-op when a state exists already; parameters must have no
    gradient.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if optimizer.state:
        return
    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                _zero_state(value)


def _zero_state(t: torch.Tensor) -> None:
    """Set one state tensor (a DTensor, a torchao quantized state or a plain tensor) to the value
    the optimizer's own initialisation gives it: zero (torchao: ``OptimState*bit.zeros``, zero
    codes and zero scales beside the unchanged lookup table ``qmap``)."""
    local = t.to_local() if type(t).__name__ == "DTensor" else t
    attrs = getattr(local, "tensor_attrs", None)
    if attrs is None:
        local.zero_()
        return
    for name in attrs:
        if name != "qmap":
            getattr(local, name).zero_()


def _cpu_foreach_by_default(node: DictConfig | dict, params: list[Any]) -> bool:
    """Whether to give ``torch.optim.Adam``/``AdamW`` ``foreach=True`` that the node left unset.

    On CPU torch picks its per-tensor loop (a Python iteration and ~10 op calls per parameter
    tensor); its ``foreach`` path runs the same element-wise ops per tensor, so the weights come
    out bit for bit the same, with one call per op for all tensors: a third less time per
    optimizer step on the small models of the CPU configs (docs/benchmarks.md, "Per-step
    overhead"). Accelerators already default to foreach or fused; DTensor parameters are left as
    torch picks.
    """
    if "foreach" in node or "fused" in node:
        return False
    cls = locate(str(node["_component_"]), "optimizer._component_")
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return all(
        type(t) is torch.nn.Parameter and t.device.type == "cpu" and t.is_floating_point()
        for t in tensors
    )


# ----------------------------------------------------------------------------------------------
# What each optimizer keeps: the planner's model of optimizer memory


@dataclass(frozen=True)
class OptimizerSpec:
    """The state layout of an optimizer, enough to count its bytes without building it.

    Fields:
        states:      state tensors per parameter (Adam: 2, m and v)
        bits:        0 = plain states in the parameter's dtype; 8 / 4 = torchao block-quantized
        block_size:  elements per fp32 scale (quantized states)
        qmap_len:    entries of the fp32 lookup table kept per quantized state tensor
        offload:     True: states (and an fp32 parameter + gradient copy) live on the host
        note:        one line for the plan's advice
    """

    states: int
    bits: int
    block_size: int = 0
    qmap_len: int = 0
    offload: bool = False
    note: str = ""


_FP = OptimizerSpec(states=2, bits=0, note="m and v in the parameter dtype")
_8BIT = OptimizerSpec(states=2, bits=8, block_size=256, qmap_len=256, note="uint8 codes")
_4BIT = OptimizerSpec(states=2, bits=4, block_size=128, qmap_len=16, note="4-bit codes")
_FP8 = OptimizerSpec(states=2, bits=8, block_size=256, qmap_len=0, note="float8 codes")

OPTIMIZER_SPECS: dict[str, OptimizerSpec] = {
    "minippo.training.optimizers.AdamW": _FP,
    "torch.optim.AdamW": _FP,
    "torch.optim.Adam": _FP,
    "torchao.optim.AdamW8bit": _8BIT,
    "torchao.optim.Adam8bit": _8BIT,
    "torchao.optim.AdamW4bit": _4BIT,
    "torchao.optim.Adam4bit": _4BIT,
    "torchao.optim.AdamWFp8": _FP8,
    "torchao.optim.AdamFp8": _FP8,
}
CPU_OFFLOAD = "minippo.training.optimizers.CPUOffload"


def optimizer_spec(node: DictConfig | dict) -> tuple[OptimizerSpec, int]:
    """(spec, minimal_size) of an optimizer config node; minimal_size is 0 unless offloaded.

    Honours ``block_size`` overrides. Raises ConfigError for components it has no model of.
    """
    comp = node.get("_component_") if node is not None else None
    known = ", ".join([*OPTIMIZER_SPECS, CPU_OFFLOAD])
    if comp is None:
        raise ConfigError(f"optimizer: needs a _component_; known to the planner: {known}")
    minimal = 0
    offload = comp == CPU_OFFLOAD
    if offload:
        minimal = int(node.get("minimal_size", 4096))
        comp = node.get("optimizer", "torch.optim.AdamW")
    if comp not in OPTIMIZER_SPECS:
        raise ConfigError(
            f"optimizer._component_={comp!r}: the memory planner has no model of this optimizer's "
            f"state; known: {known}"
        )
    spec = OPTIMIZER_SPECS[comp]
    if spec.bits and node.get("block_size") is not None:
        spec = OptimizerSpec(**{**spec.__dict__, "block_size": int(node["block_size"])})
    if offload:
        spec = OptimizerSpec(**{**spec.__dict__, "offload": True})
    return spec, minimal


@dataclass
class StateBytes:
    """Optimizer bytes of one rank: ``device`` (the accelerator or, on CPU runs, RAM) and ``host``
    (offloaded states plus the fp32 parameter and gradient copies of CPUOffload)."""

    device: int = 0
    host: int = 0


def _quantized_bytes(numel: int, spec: OptimizerSpec) -> int:
    """One block-quantized state tensor: codes + fp32 scales + fp32 lookup table."""
    codes = numel * spec.bits // 8
    return codes + 4 * (numel // spec.block_size) + 4 * spec.qmap_len


def optimizer_state_bytes(
    spec: OptimizerSpec,
    local_numels: Iterable[int],
    *,
    param_bytes: int,
    minimal_size: int = 0,
    step_on_device: bool = True,
) -> StateBytes:
    """Bytes of optimizer state for parameters with these local (per-rank) element counts.

    Per tensor of n elements (s = spec.states):
        plain:      s · n · param_bytes
        quantized:  s · (n · bits/8 + 4·n/block + 4·qmap_len)   when n >= 4096 and n % block == 0
        step:       4 bytes (an fp32 scalar; on the host for torchao and non-fused torch AdamW)
        offloaded (n >= minimal_size): the states above on the host, plus 4·n (fp32 parameter copy)
                    + 4·n (gradient copy) of pinned host memory.
    """
    out = StateBytes()
    for n in local_numels:
        if spec.bits and n >= TORCHAO_MIN_QUANT_NUMEL and n % spec.block_size == 0:
            state = spec.states * _quantized_bytes(n, spec)
            step_device = False
        else:
            state = spec.states * n * param_bytes
            step_device = step_on_device and not spec.bits
        if spec.offload and n >= minimal_size:
            out.host += state + 4 + 8 * n
            continue
        out.device += state
        if step_device:
            out.device += 4
        else:
            out.host += 4
    return out


def local_numel(shape: Sequence[int], world_size: int, rank: int = 0) -> int:
    """Elements of ``rank``'s FSDP2 shard of a parameter of ``shape`` (dim-0 ``torch.chunk``
    split: ceil(d0 / W) rows per rank, the last ranks may get fewer or none)."""
    if not shape:
        return 1 if rank == 0 else 0
    d0, rest = shape[0], math.prod(shape[1:])
    rows = -(-d0 // world_size)
    mine = max(0, min(rows, d0 - rank * rows))
    return mine * rest
