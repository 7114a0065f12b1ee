"""Helpers for multi-process tests: run a function on N gloo ranks on CPU."""

import os
import socket
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
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


@pytest.fixture
def run_on_ranks():
    """``run_on_ranks(fn, *args, world_size=2)`` runs ``fn(rank, world_size, *args)`` in
    ``world_size`` spawned processes with torchrun's environment variables set (free port per
    call); an exception on any rank fails the test. ``fn`` must be a module-level function."""

    def run(fn: Callable, *args, world_size: int = 2) -> None:
        mp.spawn(_entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=True)

    return run
