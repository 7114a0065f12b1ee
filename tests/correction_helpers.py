"""Helpers shared by the correction tests (tests/unit/test_correction.py and
tests/distributed/test_correction_fsdp.py): weight perturbation, models holding given weights,
reference logprobs."""

from __future__ import annotations

import torch

from minippo.models import Transformer, qwen3_tiny, response_logprobs
from minippo.rl.types import RolloutBatch

V = 64  # the vocabulary of the tests' tiny models


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add seeded Gaussian noise (std ``scale``) to every parameter, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device))


def model_with(weights: list[torch.Tensor], vocab: int = V) -> Transformer:
    """A fresh unsharded ``Transformer(qwen3_tiny(vocab))`` holding ``weights`` (in
    ``parameters()`` order)."""
    fresh = Transformer(qwen3_tiny(vocab))
    with torch.no_grad():
        for p, w in zip(fresh.parameters(), weights):
            p.copy_(w)
    return fresh


def score(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """The correction's default scorer without grad: ``response_logprobs`` of the batch."""
    with torch.no_grad():
        return response_logprobs(model, batch, temperature=temperature)
