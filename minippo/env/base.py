"""What an environment is: the contract between the rollout queue and a user's multi-turn task.

An episode starts from a prompt row and a seed; then, turn by turn, the policy samples tokens
until a stop id (the run's EOS and the environment's ``stop_tokens``), the per-turn cap or the
response budget ends its turn, and the environment answers with an observation (text, or token
ids) that is appended to the context, or ends the episode with its reward. The model's sampled
ids are never re-tokenized: the next turn's request is the exact context so far (prompt + every
model and observation token). docs/multi_turn.md has a complete example.

An environment is one object (``env._component_`` in a config); it keeps no per-episode state
itself: ``reset`` returns the state of an episode and ``step`` receives it, so that many episodes
run at once (in a thread pool) and an episode's state travels with its tokens (a checkpoint
pickles it: keep it picklable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One model turn, as the environment sees it.

    Fields:
        index:         0-based number of this turn in its episode.
        token_ids:     the ids the policy sampled in this turn (its stop id included).
        text:          those ids decoded.
        finish_reason: "stop" (a stop id ended the turn) or "length" (the per-turn cap or the
                       response budget did).
        last:          True when no further turn is possible (``multi_turn.max_turns`` reached or
                       the response budget spent): an observation returned now is dropped and the
                       episode ends truncated.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    last: bool


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to a turn.

    Fields:
        observation: None ends the episode; a string is turned into ids by the run's observation
                     encoder (:func:`minippo.env.observation_encoder`, the tokenizer's chat
                     template); a list of ints is appended as it is (token in, token out).
        reward:      the episode's reward when it ends (None: the run's ``reward`` component
                     scores the whole response text). Read only when the episode ends.
        state:       the episode's new state (None keeps the current one).
    """

    observation: str | list[int] | None = None
    reward: float | None = None
    state: Any = None


class Environment:
    """Base class of environments (subclassing it is optional: the queue only calls ``reset``,
    ``step`` and reads ``stop_tokens``).

    Attributes:
        stop_tokens: strings that end a model turn besides the run's EOS ids, each one token of
                     the tokenizer (e.g. a closing tool tag ``"]"``).
    """

    stop_tokens: tuple[str, ...] = ()

    def reset(self, prompt: Any, seed: int) -> Any:
        """Start an episode for ``prompt`` (the dataset row); return its state (picklable)."""
        return None

    def step(self, state: Any, turn: Turn) -> StepResult:
        """Answer the model's ``turn``: an observation, or the end of the episode."""
        raise NotImplementedError


@dataclass(frozen=True)
class MultiTurn:
    """How the rollout queue runs episodes of ``env`` (the config's ``env`` and ``multi_turn``).

    Fields:
        env:             the environment (:class:`Environment`-like).
        stop_token_ids:  the ids of ``env.stop_tokens`` (added to the run's stop ids per turn).
        encode_observation: ``encode(text, last_token_id) -> ids`` for string observations
                         (:func:`minippo.env.observation_encoder`).
        vocab_size:      observation ids must lie in ``[0, vocab_size)``.
        max_turns:       model turns per episode at most.
        max_turn_tokens: tokens one model turn may sample at most (the whole response, model and
                         observation tokens, is bounded by ``rollout.max_new_tokens``).
        step_timeout_s:  seconds one ``reset`` or ``step`` call may take.
        on_error:        "raise" (stop the run with one line) or "zero_reward" (the episode ends
                         with reward 0 and is counted in ``rollout/env_errors`` or
                         ``rollout/env_timeouts``).
        workers:         threads that run environment calls at once.
    """

    env: Any
    encode_observation: Any
    vocab_size: int
    max_turns: int
    max_turn_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    step_timeout_s: float = 30.0
    on_error: str = "raise"
    workers: int = 8

    @property
    def name(self) -> str:
        return type(self.env).__name__
