"""Environments for multi-turn rollouts: the contract (:class:`Environment`, :class:`Turn`,
:class:`StepResult`), the settings the rollout queue runs episodes with (:class:`MultiTurn`), the
thread pool that runs environment calls under a timeout (:class:`EnvRunner`) and the one
observation-tokenization helper (:func:`observation_encoder`). docs/multi_turn.md is the guide."""

from minippo.env.base import Environment, MultiTurn, StepResult, Turn
from minippo.env.observation import observation_encoder
from minippo.env.runner import ON_ERROR, EnvError, EnvRunner, Fault
from minippo.env.setup import build_multi_turn

__all__ = [
    "ON_ERROR",
    "EnvError",
    "EnvRunner",
    "Environment",
    "Fault",
    "MultiTurn",
    "StepResult",
    "Turn",
    "build_multi_turn",
    "observation_encoder",
]
