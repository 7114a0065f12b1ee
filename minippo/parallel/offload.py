"""Trainer offload: move models and optimizer states to host memory while the engine generates.

In the colocated loop the rollout engine and the trainer share one GPU. Before the engine
generates, :meth:`TrainerOffload.offload` copies every parameter, gradient and optimizer state
tensor of the actor and critic to host memory (pinned when CUDA is present, so that the copies are
asynchronous) and frees the device copies; :meth:`TrainerOffload.reload` copies them back before
training::

    offload = TrainerOffload([(actor, actor_opt), (critic, critic_opt)])
    offload.offload()      # seconds; the engine's KV cache can take the freed memory
    ...                    # generate
    offload.reload()       # seconds; training continues exactly as without the round trip

Only storage moves: the Parameter objects stay the same (the optimizer's state keys still are the
model's parameters), values are bit-identical. FSDP2 modules move through ``nn.Module._apply``,
which FSDP2 overrides to re-register the moved local shards; plain modules (one process, possibly
on the CPU) move the same way. Buffers (the RoPE tables) stay where they are. Tensor subclasses
(DTensor, torchao's quantized optimizer states) are copied inner tensor by inner tensor.

Each direction moves this rank's parameter shards + gradients (usually None: the recipe zeroes
with ``set_to_none``) + optimizer states: :attr:`TrainerOffload.nbytes`.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from minippo.parallel.fsdp import reshard_all

__all__ = ["TrainerOffload"]

HOST = torch.device("cpu")


class TrainerOffload:
    """Moves models, their gradients and their optimizers' states to host memory and back.

    Args:
        pairs: ``(module, optimizer or None)`` per trained model; a module's parameters must all
            be on one device (FSDP2: this rank's shards).

    ``offload()`` while offloaded and ``reload()`` while not are no-ops that return 0.0, so a
    recipe may reload unconditionally (e.g. before a checkpoint). Optimizer state created while
    offloaded is not tracked; the state present at ``offload()`` is what moves back.
    """

    def __init__(self, pairs: list[tuple[nn.Module, torch.optim.Optimizer | None]]) -> None:
        for _, optimizer in pairs:
            if optimizer is not None and not isinstance(getattr(optimizer, "state", None), dict):
                raise TypeError(
                    f"TrainerOffload: {type(optimizer).__name__} has no .state dict to move (e.g. "
                    "torchao's CPUOffloadOptimizer, whose states are already on the host); set "
                    "rollout.offload_trainer=false or use "
                    "optimizer._component_=minippo.training.optimizers.AdamW"
                )
        self.pairs = list(pairs)
        self._offloaded = False
        self._homes: list[torch.device] = []  # per module: the device its parameters came from
        # (optimizer, its state of one parameter, key, the device the tensor came from)
        self._state_homes: list[tuple[torch.optim.Optimizer, dict, str, torch.device]] = []

    @property
    def offloaded(self) -> bool:
        """True between ``offload()`` and ``reload()``."""
        return self._offloaded

    @property
    def nbytes(self) -> int:
        """Bytes one ``offload()`` (or ``reload()``) moves: this rank's parameters, gradients and
        optimizer states (quantized states: codes + scales + lookup tables)."""
        total = 0
        for module, optimizer in self.pairs:
            total += sum(_nbytes(t) for t in _param_tensors(module))
            if optimizer is not None:
                total += sum(_nbytes(v) for _, _, v in _state_tensors(optimizer))
        return total

    @torch.no_grad()
    def offload(self) -> float:
        """Move everything to host memory and free the device copies; returns the seconds taken
        (0.0 if already offloaded)."""
        if self.offloaded:
            return 0.0
        start = time.perf_counter()
        pin = torch.cuda.is_available()
        self._offloaded = True  # also when a move below fails: reload() brings back what moved
        for module, optimizer in self.pairs:
            devices = {p.device for p in module.parameters()}
            if len(devices) != 1:
                on = ", ".join(sorted(map(str, devices))) or "no device (no parameters)"
                raise ValueError(
                    f"TrainerOffload: {type(module).__name__} has parameters on {on}; pass "
                    "modules whose parameters all live on one device"
                )
            self._homes.append(devices.pop())
            _move_module(module, HOST, pin)
            if optimizer is not None:
                for state, key, value in _state_tensors(optimizer):
                    state[key] = _move_state(optimizer, key, value, HOST, pin)
                    self._state_homes.append((optimizer, state, key, value.device))
        _synchronize()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the freed blocks back, e.g. to an engine process
        return time.perf_counter() - start

    @torch.no_grad()
    def reload(self) -> float:
        """Move everything back to the devices it came from; returns the seconds taken (0.0 if
        not offloaded)."""
        if not self.offloaded:
            return 0.0
        start = time.perf_counter()
        # _homes is shorter than pairs when an offload() failed half-way: the rest never moved
        for (module, _), home in zip(self.pairs, self._homes, strict=False):
            _move_module(module, home, pin=False)
        for optimizer, state, key, home in self._state_homes:
            state[key] = _move_state(optimizer, key, state[key], home, pin=False)
        self._homes, self._state_homes, self._offloaded = [], [], False
        _synchronize()
        return time.perf_counter() - start


def copy_tensor(t: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A copy of ``t`` in new storage on ``device`` (pinned if ``pin``), same class, shape and
    strides. Wrapper subclasses (DTensor, torchao's OptimState8bit...) are rebuilt around copies
    of their inner tensors (torchao's low-bit states implement no ``clone``). Asynchronous on
    CUDA: synchronize before reading the result on the host."""
    if is_traceable_wrapper_subclass(t):
        names, ctx = t.__tensor_flatten__()
        inner = {name: getattr(t, name) for name in names}  # DTensor lists its mesh here too
        inner = {k: copy_tensor(v, device, pin) if _is_tensor(v) else v for k, v in inner.items()}
        return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
    out = torch.empty_like(t, device=device, pin_memory=pin, requires_grad=False)
    return out.copy_(t, non_blocking=True)


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _nbytes(t: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(t):
        inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        return sum(_nbytes(x) for x in inner if _is_tensor(x))
    return t.numel() * t.element_size()


def _param_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters (tied ones once) and their gradients."""
    params = list(module.parameters())
    return params + [p.grad for p in params if p.grad is not None]


def _move_module(module: nn.Module, device: torch.device, pin: bool) -> None:
    """Replace the storage of every parameter and gradient of ``module`` by a copy on ``device``.

    The copies are made first, once per tensor (a tied parameter is visited by ``_apply`` once per
    module that holds it); ``_apply`` then puts them in place: ``param.data = copy`` for plain
    tensors, a swap of the contents for DTensors, after which FSDP2 re-registers its shards. It
    gets a fresh alias each time, since a swap would otherwise change our copy.
    """
    reshard_all(module)  # FSDP2: the sharded parameters must be the registered ones
    # keyed by id; each entry keeps its tensor alive, so that no id is reused during _apply
    copies = {id(t): (t, copy_tensor(t, device, pin)) for t in _param_tensors(module)}
    if device.type == "cpu":  # FSDP2 re-pads uneven shards by a CPU read of the host copies
        _synchronize()

    def fn(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:  # a buffer
            return t
        return copies[id(t)][1].detach()

    module._apply(fn)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str, torch.Tensor]]:
    return [
        (state, key, value)
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    ]


def _move_state(
    optimizer: torch.optim.Optimizer, key: str, t: torch.Tensor, device: torch.device, pin: bool
) -> torch.Tensor:
    try:
        return copy_tensor(t, device, pin)
    except Exception as e:  # a tensor subclass without the flatten protocol or empty_like/copy_
        raise RuntimeError(
            f"TrainerOffload cannot move {type(optimizer).__name__}'s state {key!r} "
            f"({type(t).__name__}): {e}. Set rollout.offload_trainer=false or use "
            "optimizer._component_=minippo.training.optimizers.AdamW"
        ) from e


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
