"""Helpers for multi-process tests: run a function on N gloo ranks on CPU."""

import pytest

from tests.helpers import run_on_ranks as _run_on_ranks


@pytest.fixture
def run_on_ranks():
    """``run_on_ranks(fn, *args, world_size=2)`` runs ``fn(rank, world_size, *args)`` in
    ``world_size`` spawned processes with torchrun's environment variables set (free port per
    call); an exception on any rank fails the test. ``fn`` must be a module-level function
    (``tests.helpers.run_on_ranks``, also importable directly)."""
    return _run_on_ranks
