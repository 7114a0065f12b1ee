"""Rollout engines: the protocol every backend implements, the embedded TorchEngine, and the
SGLang backend (importing it is cheap: sglang itself is imported only when an engine starts)."""

from minippo.engine.protocol import (
    FINISH_REASONS,
    Completion,
    FinishReason,
    GenerateRequest,
    GroupCounter,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
    compute_dtype,
    settled_finish_reason,
    validate_requests,
)
from minippo.engine.sglang_engine import SGLangEngine, SGLangEngineDied
from minippo.engine.torch_engine import TorchEngine

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "FinishReason",
    "GenerateRequest",
    "GroupCounter",
    "RolloutEngine",
    "SGLangEngine",
    "SGLangEngineDied",
    "SamplingParams",
    "TorchEngine",
    "WeightBucket",
    "compute_dtype",
    "settled_finish_reason",
    "validate_requests",
]
