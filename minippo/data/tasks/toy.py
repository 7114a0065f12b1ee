"""Toy prompt sets: arithmetic and digit-string tasks, drawn from a seeded ``random.Random``."""

from __future__ import annotations

import random
from collections.abc import Callable

from minippo.data.prompts import PromptDataset, PromptExample

DIGIT_OPS: dict[str, Callable[[str], str]] = {
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}


def _encode(tokenizer, text: str, add_bos: bool) -> tuple[int, ...]:
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    if add_bos and bos is not None:
        ids = [bos, *ids]
    return tuple(ids)


def arithmetic_task(
    tokenizer,
    *,
    num_prompts: int = 1024,
    min_operand: int = 0,
    max_operand: int = 9,
    ops: str = "+",
    seed: int = 0,
    add_bos: bool = True,
) -> PromptDataset:
    """Prompts ``"{a}{op}{b}="`` with answers ``str(a op b)``; a, b uniform in [min, max].

    Args:
        tokenizer: anything with ``encode(str) -> list[int]`` (e.g. ``TinyTokenizer``).
        num_prompts: size of the (fixed, seeded) prompt set.
        min_operand / max_operand: operand range (inclusive).
        ops: the operators to draw from, a string over ``"+-*"``.
        seed: the prompt set is a function of the arguments and this seed only.
        add_bos: start every prompt with the tokenizer's BOS id (when it has one).
    """
    if not ops or any(o not in "+-*" for o in ops):
        raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}; e.g. ops='+'")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand ({min_operand}) <= max_operand ({max_operand})")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    examples = []
    for i in range(num_prompts):
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(min_operand, max_operand)
        op = rng.choice(ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        text = f"{a}{op}{b}="
        examples.append(PromptExample(i, _encode(tokenizer, text, add_bos), text, str(value)))
    return PromptDataset(examples, name=f"arithmetic({ops}, {min_operand}..{max_operand})")


def digit_task(
    tokenizer,
    *,
    op: str = "copy",
    length: int = 3,
    alphabet: str = "0123456789",
    num_prompts: int = 1024,
    seed: int = 0,
    add_bos: bool = True,
    min_length: int | None = None,
) -> PromptDataset:
    """Prompts ``"{digits}="`` with answers ``op(digits)`` (copy, reverse or sort).

    Args:
        tokenizer: anything with ``encode(str) -> list[int]``.
        op: one of ``DIGIT_OPS`` ("copy", "reverse", "sort").
        length: number of symbols in each string (the answer has the same length); with
            ``min_length``, of the longest strings.
        alphabet: the symbols to draw from (a smaller alphabet is an easier task).
        num_prompts: size of the (fixed, seeded) prompt set.
        seed: the prompt set is a function of the arguments and this seed only.
        add_bos: start every prompt with the tokenizer's BOS id (when it has one).
        min_length: None: every string has ``length`` symbols; else each string's length is
            drawn uniformly from ``min_length..length`` (answers of varied length: in a batch cut
            by a stop, short groups finish while long ones are still decoding).
    """
    if op not in DIGIT_OPS:
        raise ValueError(f"op must be one of {sorted(DIGIT_OPS)}, got {op!r}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if len(alphabet) < 2 or len(set(alphabet)) != len(alphabet) or "=" in alphabet:
        raise ValueError(
            f"alphabet must have >= 2 distinct symbols and no '=', got {alphabet!r}; "
            "e.g. alphabet='0123'"
        )
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if min_length is not None and not 1 <= min_length <= length:
        raise ValueError(
            f"min_length must be null or in 1..length ({length}), got {min_length}; "
            "e.g. dataset.min_length=2"
        )
    rng = random.Random(seed)
    examples = []
    for i in range(num_prompts):
        n = length if min_length is None else rng.randint(min_length, length)
        s = "".join(rng.choice(alphabet) for _ in range(n))
        text = f"{s}="
        examples.append(PromptExample(i, _encode(tokenizer, text, add_bos), text, DIGIT_OPS[op](s)))
    lengths = f"{length}" if min_length is None else f"{min_length}-{length}"
    return PromptDataset(examples, name=f"digits({op}, length {lengths}, alphabet {alphabet!r})")
