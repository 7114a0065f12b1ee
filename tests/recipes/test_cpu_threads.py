"""The CPU thread split: on a CPU-only node each rank's trainer and each rank's engine process
share the cores without oversubscribing them (spinning intra-op threads of an oversubscribed
process slow every process down), and ``cpu_threads`` sets the trainer's count."""

import os
import runpy
from pathlib import Path

import pytest
import torch

from minippo.config import load_config
from minippo.engine.torch_engine import default_num_threads

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe_cls():
    before = torch.get_num_threads()
    yield runpy.run_path(str(REPO / "recipes" / "async_ppo.py"))["AsyncPPORecipe"]
    torch.set_num_threads(before)


def trainer_threads(recipe_cls, out: Path, overrides=()) -> int:
    """Torch threads the recipe sets for its trainer (its ``__init__`` only: nothing is built)."""
    recipe = recipe_cls(load_config("tiny_cpu", [f"output_dir={out}", *overrides]))
    try:
        return torch.get_num_threads()
    finally:
        recipe.cleanup()


@pytest.mark.parametrize(
    "cores, ranks", [(2, 1), (4, 1), (16, 1), (4, 2), (16, 2), (3, 2), (16, 4), (8, 8)]
)
def test_trainers_and_engines_of_all_ranks_fit_in_the_cores(
    recipe_cls, monkeypatch, tmp_path, cores, ranks
):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))  # what torchrun sets on each rank
    trainer = trainer_threads(recipe_cls, tmp_path / "run")
    engine = default_num_threads()  # the engine the recipe builds (engine.num_threads unset)
    assert trainer >= 1 and engine >= 1
    # every rank runs one trainer and one engine process; each gets at least one thread
    assert ranks * (trainer + engine) <= max(cores, 2 * ranks), (trainer, engine)
    if cores >= 4 * ranks:  # and with cores to spare, each side gets a fair share
        assert trainer >= cores // (4 * ranks) and engine >= cores // (4 * ranks)


def test_cpu_threads_sets_the_trainer_threads(recipe_cls, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    assert trainer_threads(recipe_cls, tmp_path / "run", ["cpu_threads=3"]) == 3
