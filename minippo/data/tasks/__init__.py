"""Built-in toy tasks: seeded prompt sets made on the fly (no downloads) for tiny models.

* :func:`arithmetic_task`: ``"12+7="`` -> ``"19"``; reward :class:`~minippo.data.rewards.ExactMatch`.
* :func:`digit_task`: copy / reverse / sort a digit string, ``"3012="`` -> ``"3012"`` (copy);
  reward :class:`~minippo.data.rewards.PerPositionMatch` (partial credit per position, so a
  critic and GAE have something to learn).
"""

from minippo.data.tasks.toy import DIGIT_OPS, arithmetic_task, digit_task

__all__ = ["DIGIT_OPS", "arithmetic_task", "digit_task"]
