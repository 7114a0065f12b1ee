"""Rollout engines: the protocol every backend implements, and the embedded TorchEngine."""

from minippo.engine.protocol import (
    FINISH_REASONS,
    Completion,
    FinishReason,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
    validate_requests,
)
from minippo.engine.torch_engine import TorchEngine

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "FinishReason",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingParams",
    "TorchEngine",
    "WeightBucket",
    "validate_requests",
]
