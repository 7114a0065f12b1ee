"""Small helpers shared by test modules (imported as ``tests.helpers``): free ports and gloo ranks
for multi-process tests, bytes autograd saves for backward."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT / --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    # the same environment torchrun provides, so code under test can call init_distributed()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    fn(rank, world_size, *args)


def run_on_ranks(fn: Callable, *args: Any, world_size: int = 2) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with torchrun's
    environment variables set (a free port per call); an exception on any rank raises here.
    ``fn`` must be a module-level function (it is pickled by name)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def saved_bytes(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(bytes, fn())``: the bytes of the distinct storages that autograd saves for backward
    (outside checkpointed regions; parameters excluded) while ``fn`` runs the forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
