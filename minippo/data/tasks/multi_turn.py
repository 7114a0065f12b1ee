r"""Built-in multi-turn tasks for tiny models: two environments (``env._component_``) over the
toy prompt sets, scored by the environment itself (``StepResult.reward``).

* :class:`RetryWithFeedback` over :func:`~minippo.data.tasks.digit_task` (``"301="``, answer
  ``"103"`` for ``op: reverse``): a first answer that is exactly right scores 1; a wrong one gets
  the observation ``":103="`` (the answer as a hint) and the second answer scores
  ``retry_reward`` x the fraction of its positions that are right: lower than a right first
  answer, and a copy of the observation.
* :class:`Calculator` over :func:`~minippo.data.tasks.arithmetic_task` (``"3+4="``, answer
  ``"7"``): a turn that ends with the calculator tag ``"("`` (the environment's stop token) calls
  the calculator on the prompt's expression, whose result comes back as the observation ``"7"``;
  the model then answers (a copy of the tokens just before it). The answer (the first turn's text when it calls no tool) scores the
  fraction of its positions that are right; an episode that called the tool scores
  ``call_reward + (1 - call_reward) x`` that fraction (a format reward for a well-formed call, as
  agentic recipes give, without which a random policy almost never finds the tool).
"""

from __future__ import annotations

import re
from typing import Any

from minippo.env import Environment, StepResult, Turn


def position_match(text: str, answer: str) -> float:
    """The fraction of the answer's positions that ``text`` has right (``text`` read from its
    start; a longer text is compared on the answer's length)."""
    if not answer:
        return 0.0
    return sum(a == b for a, b in zip(text, answer, strict=False)) / len(answer)


class RetryWithFeedback(Environment):
    """A wrong first answer gets the answer as a hint; the retry scores ``retry_reward`` at most.

    Args:
        retry_reward: the reward of a fully right second answer (< 1: lower than a right first
            answer).
    """

    def __init__(self, retry_reward: float = 0.9) -> None:
        if not 0.0 <= retry_reward <= 1.0:
            raise ValueError(f"retry_reward must be in [0, 1], got {retry_reward!r}")
        self.retry_reward = float(retry_reward)

    def reset(self, prompt: Any, seed: int) -> dict:
        return {"answer": prompt.answer}

    def step(self, state: dict, turn: Turn) -> StepResult:
        answer = state["answer"]
        score = position_match(turn.text, answer)
        if turn.index == 0 and score < 1.0:
            return StepResult(observation=f":{answer}=", reward=0.0)  # the hint
        return StepResult(reward=score if turn.index == 0 else self.retry_reward * score)


_EXPRESSION = re.compile(r"^\s*(\d+)\s*([+\-*])\s*(\d+)\s*=?\s*$")


def calculate(expression: str) -> int:
    """The value of ``"a+b"``, ``"a-b"`` or ``"a*b"`` (non-negative integers); ValueError else."""
    m = _EXPRESSION.match(expression)
    if m is None:
        raise ValueError(f"the calculator reads 'a+b', 'a-b' or 'a*b', got {expression!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


class Calculator(Environment):
    """A calculator tool: a turn ending with the tag ``"("`` calls it on the prompt's expression
    and the result comes back as observation tokens; the final answer is scored per position.

    Args:
        call_reward: the share of the reward a tool call earns by itself (the answer the rest).
    """

    stop_tokens = ("(",)

    def __init__(self, call_reward: float = 0.2) -> None:
        if not 0.0 <= call_reward < 1.0:
            raise ValueError(f"call_reward must be in [0, 1), got {call_reward!r}")
        self.call_reward = float(call_reward)

    def reset(self, prompt: Any, seed: int) -> dict:
        return {"expression": prompt.prompt, "answer": prompt.answer, "called": False}

    def step(self, state: dict, turn: Turn) -> StepResult:
        if turn.index == 0 and turn.text.endswith("("):  # a tool call
            state["called"] = True
            value = calculate(state["expression"])
            return StepResult(observation=str(value), reward=self.call_reward)
        score = position_match(turn.text, state["answer"])
        if state["called"]:
            score = self.call_reward + (1.0 - self.call_reward) * score
        return StepResult(reward=score)
