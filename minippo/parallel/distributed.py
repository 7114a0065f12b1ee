"""Process-group setup for runs started by torchrun (or as a single plain process), the lifetime of
the processes of a run (:func:`die_with_parent`: a rank dies with its launcher, an engine process
with its trainer) and the small collectives over all ranks that the corrections use (a few floats;
the union of weight versions)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "all_reduce_floats",
    "apply_deterministic",
    "check_gpu_capability",
    "destroy_distributed",
    "die_with_parent",
    "init_distributed",
    "process_group_timeout_s",
    "union_over_ranks",
]

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_watched_parent: int | None = None  # the parent pid the watchdog of this process follows

# How long a collective may wait for the slowest rank before the process group's watchdog ends the
# run (``parallel.timeout_s``; torch's own default is 10 minutes for NCCL). Sized for the longest
# stretch in which ranks legitimately drift apart: a DCP save writes every rank's shards of the
# models and optimizers (the 4B config: about 7.5 GB per rank, some minutes on a slow or shared
# disk, and one rank may also export the HF weights) and a publish in lockstep of a 4B model into
# engines that are still finishing a wave; 10 minutes ended such runs. 45 minutes leaves room for
# that, and a hang still ends the run within the hour.
DEFAULT_TIMEOUT_S = 45 * 60.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Fields:
        rank:        global rank (0 in a single process)
        world_size:  number of processes (1 in a single process)
        local_rank:  rank on this node (selects the GPU)
        device:      ``cuda:<local_rank>`` when CUDA is available, else ``cpu``
        distributed: True when a process group is initialised
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, cfg: Any = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and return where this process sits.

    backend: None picks ``nccl`` on CUDA and ``gloo`` on CPU. Without torchrun's variables this is
    a single process: no process group is created and ``DistInfo(0, 1, 0, device, False)`` is
    returned. Calling it again once the group exists returns the same information.

    cfg: the run's config (optional), read for ``parallel.timeout_s`` (the process group's timeout,
    :func:`process_group_timeout_s`; without a cfg :data:`DEFAULT_TIMEOUT_S`), ``deterministic``
    (:func:`apply_deterministic`, before any kernel runs) and ``dtype`` (on CUDA,
    :func:`check_gpu_capability` of this rank's GPU). Under NCCL, ``NCCL_NVLS_ENABLE=0`` is set
    unless the environment sets it: SGLang disables NVLS for its own communicators, and the
    trainer's (created here, eagerly, before any engine) would otherwise take NVLS buffers
    (gigabytes per rank on NVSwitch machines) that the memory plan does not count.

    A rank dies with the process that started it (torchrun's agent; :func:`die_with_parent`):
    killing the launcher, even with SIGKILL, leaves no rank training on its own.
    """
    cuda = torch.cuda.is_available()
    timeout_s = DEFAULT_TIMEOUT_S if cfg is None else process_group_timeout_s(cfg)
    if cfg is not None:
        from minippo.training.preflight import setting

        apply_deterministic(setting(cfg, "deterministic"))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device, _ = placement(0, cuda=cuda, device_count=torch.cuda.device_count() if cuda else 0)
        _check_device(device, cfg)
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device, distributed=False)
    die_with_parent()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    count = torch.cuda.device_count() if cuda else 0
    device, backend = placement(local_rank, cuda=cuda, device_count=count, backend=backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _check_device(device, cfg)
    if not dist.is_initialized():
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            device_id=device if backend == "nccl" else None,
            timeout=timedelta(seconds=timeout_s),
        )
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, distributed=True
    )


def _select(cfg: Any, key: str, default: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default)


def process_group_timeout_s(cfg: Any) -> float:
    """``parallel.timeout_s`` of ``cfg``, else :data:`DEFAULT_TIMEOUT_S` (the key is optional).
    Raises ValueError naming the key for a value that is not a positive number."""
    from minippo.training.preflight import setting  # the schema states the default

    value = setting(cfg, "parallel.timeout_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"parallel.timeout_s must be a number of seconds > 0, got {value!r}; omit it for the "
            f"default ({DEFAULT_TIMEOUT_S:.0f})"
        )
    return float(value)


def apply_deterministic(enabled: bool) -> None:
    """``deterministic: true``: make the trainer's kernels deterministic, so that a GPU run repeats
    itself bit for bit and a resumed run equals the uninterrupted one there as on CPU.

    Sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless set: cuBLAS needs a fixed workspace before
    its first call) and ``torch.use_deterministic_algorithms(True)``: the flash-attention backward
    then takes its deterministic path (no atomic adds), and an op with no deterministic CUDA
    kernel raises instead of running. ``False`` changes nothing (torch's default). Call it before
    any CUDA kernel runs."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


# varlen flash attention (the packed passes' kernel for bf16/fp16 on CUDA) needs Ampere or newer
FLASH_MIN_CAPABILITY = (8, 0)


def check_gpu_capability(capability: tuple[int, int], name: str, dtype: str) -> str | None:
    """The one-line reason a GPU of compute ``capability`` (``torch.cuda.get_device_capability``)
    cannot train in ``dtype``, or None. bf16/fp16 attention goes to flash attention, which needs
    sm80 (A100, H100, RTX 30xx and newer); below that it would fail inside the first forward."""
    from minippo.config import canonical_dtype

    if canonical_dtype(dtype, "dtype") == "float32" or tuple(capability) >= FLASH_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"dtype={dtype} on {name} (compute capability sm{major}{minor}): the trainer's attention "
        "runs flash attention, which needs sm80 or newer (A100, H100, RTX 30xx); use such a GPU"
    )


def _check_device(device: torch.device, cfg: Any) -> None:
    """Raise RuntimeError with :func:`check_gpu_capability`'s line for this rank's GPU."""
    if device.type != "cuda" or cfg is None or _select(cfg, "dtype", None) is None:
        return
    problem = check_gpu_capability(
        torch.cuda.get_device_capability(device),
        torch.cuda.get_device_name(device),
        str(_select(cfg, "dtype", None)),
    )
    if problem is not None:
        raise RuntimeError(problem)


def die_with_parent(
    sig: int = signal.SIGKILL, *, parent_pid: int | None = None, prctl: bool = True
) -> None:
    """Make this process receive ``sig`` (default SIGKILL) when its parent process dies.

    Two mechanisms, so that no process of a run outlives it (torchrun starts each rank in a
    session of its own, so a killed launcher would otherwise leave its ranks training):

    * Linux: ``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` when the parent *thread*
      that started this process ends, so pass ``prctl=False`` when that was not the parent's
      main thread (a helper thread that ends early would kill this process);
    * everywhere: a daemon thread that checks every 0.5 s whether this process was re-parented
      (its parent is gone) and then sends ``sig`` to this process.

    ``parent_pid``: the parent's pid as the parent saw it (default: ``os.getppid()`` now); if the
    parent is already gone when this is called, ``sig`` is sent at once. Idempotent.
    """
    global _watched_parent
    parent = os.getppid() if parent_pid is None else int(parent_pid)
    if _watched_parent == parent:
        return
    if prctl and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.debug(
                "prctl(PR_SET_PDEATHSIG) failed (errno %d); the watchdog remains",
                ctypes.get_errno(),
            )
    if os.getppid() != parent:  # the parent ended before the death signal was armed
        os.kill(os.getpid(), sig)
    _watched_parent = parent
    threading.Thread(
        target=_watch_parent, args=(parent, sig), name="minippo-parent-watchdog", daemon=True
    ).start()


def _watch_parent(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), sig)


def destroy_distributed() -> None:
    """Tear down the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def placement(
    local_rank: int, *, cuda: bool, device_count: int, backend: str | None = None
) -> tuple[torch.device, str]:
    """The device and process-group backend of the rank with ``local_rank`` on its node:
    ``cuda:<local_rank>`` and ``nccl`` where CUDA is available (``device_count`` devices), else the
    CPU and ``gloo``; ``backend`` overrides the backend. Raises for a local rank without a device
    and for NCCL without CUDA."""
    if cuda and local_rank >= device_count:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but only {device_count} CUDA devices are visible; lower "
            "--nproc-per-node"
        )
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    return device, backend


def collective_device(default: torch.device | str = "cpu") -> torch.device:
    """Where a tensor handed to a collective of the default process group must live: the current
    CUDA device under NCCL (which reduces accelerator tensors only), else ``default``."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(default)


def _several_ranks() -> bool:
    """Whether a default process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_floats(values: list[float], op: str, device: torch.device) -> list[float]:
    """Sum (``op="sum"``) or max (``op="max"``) of a few floats over all ranks, in float64.

    One collective on ``device`` (where the backend expects tensors: the accelerator under NCCL);
    the values themselves in a single process. Every rank must call it.
    """
    if op not in ("sum", "max"):
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if not _several_ranks():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    """Element by element, the largest of every rank's ``values`` (each rank passes a list of the
    same length): one small all-reduce (on CUDA one wait for the device). Every rank must call
    it; a single process gets its own values."""
    return [int(v) for v in all_reduce_floats([float(v) for v in values], "max", device)]


def union_over_ranks(values: Iterable[int], device: torch.device) -> list[int]:
    """The sorted union of every rank's ints (each rank passes its own, all get the union).

    Two small all-reduces: the range (max of −min and of max), then one flag per int in it, so it
    suits a few close values such as weight versions. Every rank must call it.
    """
    present = sorted({int(v) for v in values})
    if not _several_ranks():
        return present
    lo, hi = (present[0], present[-1]) if present else (math.inf, -math.inf)
    neg_lo, hi = all_reduce_floats([-lo, hi], "max", device)
    lo = -neg_lo
    if hi < lo:  # no rank has any value
        return []
    lo, hi = int(lo), int(hi)
    flags = [0.0] * (hi - lo + 1)
    for v in present:
        flags[v - lo] = 1.0
    flags = all_reduce_floats(flags, "max", device)
    return [lo + i for i, f in enumerate(flags) if f > 0]
