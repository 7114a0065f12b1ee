r"""Built-in toy tasks: seeded prompt sets made on the fly (no downloads) for tiny models.

* :func:`arithmetic_task`: ``"12+7="`` -> ``"19"``; reward :class:`~minippo.data.rewards.ExactMatch`.
* :func:`boxed_arithmetic_task`: ``"3+4=?"`` rendered with the chat template, answered
  ``\\boxed{7}``; reward :class:`~minippo.data.rewards.MathAnswerMatch` (the real math path).
* :func:`digit_task`: copy / reverse / sort a digit string, ``"3012="`` -> ``"3012"`` (copy);
  reward :class:`~minippo.data.rewards.PerPositionMatch` (partial credit per position, so a
  critic and GAE have something to learn).
* multi-turn environments (``env._component_``, docs/multi_turn.md):
  :class:`~minippo.data.tasks.multi_turn.RetryWithFeedback` (a wrong answer gets a hint, the
  retry scores lower) and :class:`~minippo.data.tasks.multi_turn.Calculator` (a tool call, the
  result as observation tokens, then the answer).
"""

from minippo.data.tasks.math import boxed_arithmetic_task
from minippo.data.tasks.multi_turn import Calculator, RetryWithFeedback
from minippo.data.tasks.toy import DIGIT_OPS, arithmetic_task, digit_task

__all__ = [
    "DIGIT_OPS",
    "Calculator",
    "RetryWithFeedback",
    "arithmetic_task",
    "boxed_arithmetic_task",
    "digit_task",
]
