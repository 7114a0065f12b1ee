r"""A math task on the real math path: arithmetic questions rendered with the chat template, answers
written in ``\boxed{}`` and scored by :class:`~minippo.data.rewards.MathAnswerMatch`."""

from __future__ import annotations

import random
from typing import Any

from minippo.data.loading import format_prompt
from minippo.data.prompts import PromptDataset, PromptExample

SPLITS = ("all", "train", "test")


def _questions(
    min_operand: int, max_operand: int, ops: str, min_answer: int | None, max_answer: int | None
) -> list[tuple[int, str, int, int]]:
    """Every distinct question ``(a, op, b, value)`` of the ranges, in a fixed order."""
    out = []
    for op in dict.fromkeys(ops):  # in the order given, duplicates once
        for a in range(min_operand, max_operand + 1):
            for b in range(min_operand, max_operand + 1):
                value = a + b if op == "+" else a - b if op == "-" else a * b
                if (min_answer is None or value >= min_answer) and (
                    max_answer is None or value <= max_answer
                ):
                    out.append((a, op, b, value))
    return out


def boxed_arithmetic_task(
    tokenizer: Any,
    *,
    num_prompts: int | None = 1024,
    min_operand: int = 0,
    max_operand: int = 9,
    ops: str = "+",
    min_answer: int | None = None,
    max_answer: int | None = None,
    balance_answers: bool = False,
    question: str = "{a}{op}{b}=?",
    prompt_suffix: str = "",
    system_prompt: str | None = None,
    split: str = "all",
    holdout: float = 0.0,
    split_seed: int = 0,
    seed: int = 0,
    add_bos: bool = True,
) -> PromptDataset:
    r"""Arithmetic questions through the chat template; the answer is to be written ``\boxed{7}``.

    Each prompt is ``format_prompt(tokenizer, question.format(a=, op=, b=), template="chat",
    system_prompt=..., prompt_suffix=...)`` (``tokenizer.apply_chat_template``, generation prompt
    added), the reference answer the bare number ``str(a op b)`` (as in DAPO-Math), for
    :class:`~minippo.data.rewards.MathAnswerMatch`: a completion scores 1 when its last
    ``\boxed{}`` holds that number.

    The distinct questions are every ``(a, op, b)`` with a, b in [min_operand, max_operand] and
    an answer in [``min_answer``, ``max_answer``]; ``split`` picks among them: ``all``, or a
    held-out partition (``train`` / ``test``) that puts ``round(holdout x n)`` of the n questions,
    chosen by ``split_seed``, in ``test``, the rest in ``train`` (the same two sets for any
    ``seed``).

    Args:
        tokenizer: ``encode(str) -> list[int]`` and ``apply_chat_template`` (``TinyTokenizer``
            with ``extra_tokens=['\\boxed{', '}']``, or an HF tokenizer).
        num_prompts: prompts drawn uniformly (with replacement, by ``seed``) from the split's
            questions; None: each question of the split once, in a fixed order (an eval set).
        min_operand / max_operand: operand range (inclusive, >= 0).
        ops: the operators, a string over ``"+-*"``.
        min_answer / max_answer: keep only questions whose answer is in this range (e.g.
            ``min_answer=0`` drops negative differences, ``max_answer=9`` keeps one-digit
            answers); None: no bound.
        balance_answers: draw an answer uniformly among the split's answers, then a question
            with that answer (``num_prompts`` draws only). Sums are not uniform (with operands
            0..3, the answer 3 has 4 of the 16 questions): balanced, no constant answer is right
            more often than another.
        question: the user message, a format string with ``{a}``, ``{op}`` and ``{b}``.
        prompt_suffix / system_prompt: see :func:`minippo.data.format_prompt` (e.g. an
            instruction on the answer format, ``" put the answer in \\boxed{}."``).
        split: ``all``, ``train`` or ``test``.
        holdout: the fraction of distinct questions in ``test`` (``split`` train/test only).
        split_seed: which questions are held out.
        seed: the drawn prompt list is a function of the arguments and this seed only.
        add_bos: start every prompt with the tokenizer's BOS id when it has one and the chat
            template did not write it.
    """
    if not ops or any(o not in "+-*" for o in ops):
        raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}; e.g. ops='+'")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand ({min_operand}) <= max_operand ({max_operand})")
    if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 1):
        raise ValueError(
            f"num_prompts must be >= 1 or null (each question once), got {num_prompts}"
        )
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if split == "all" and holdout:
        raise ValueError(
            f"holdout={holdout} holds questions out only with split=train or split=test (split=all "
            "uses every question); set split=train (and split=test to validate) or holdout=0.0"
        )
    if split != "all" and not 0.0 < holdout < 1.0:
        raise ValueError(
            f"split={split!r} needs holdout in (0, 1) (the fraction of questions held out for "
            f"test), got {holdout}; e.g. holdout=0.2"
        )
    try:
        question.format(a=0, op="+", b=0)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"question must be a format string with only {{a}}, {{op}} and {{b}} fields, got "
            f"{question!r} ({type(e).__name__}: {e})"
        ) from None
    questions = _questions(min_operand, max_operand, ops, min_answer, max_answer)
    if not questions:
        raise ValueError(
            f"no question has an answer in [min_answer={min_answer}, max_answer={max_answer}] "
            f"(operands {min_operand}..{max_operand}, ops {ops!r}); lower min_answer or raise "
            f"max_answer"
        )
    if split != "all":
        n_test = round(holdout * len(questions))
        if not 0 < n_test < len(questions):
            raise ValueError(
                f"holdout={holdout} of {len(questions)} questions leaves an empty "
                f"{'test' if n_test == 0 else 'train'} split; pick holdout in "
                f"[{1 / len(questions):.3g}, {1 - 1 / len(questions):.3g}]"
            )
        order = list(range(len(questions)))
        random.Random(split_seed).shuffle(order)
        held = set(order[:n_test])
        keep = held if split == "test" else set(order[n_test:])
        questions = [q for i, q in enumerate(questions) if i in keep]
    if num_prompts is None:
        picked = questions
    else:
        rng = random.Random(seed)
        if balance_answers:  # an answer uniformly, then a question with that answer
            by_answer: dict[int, list[tuple[int, str, int, int]]] = {}
            for q in questions:
                by_answer.setdefault(q[3], []).append(q)
            groups = list(by_answer.values())
            picked = [rng.choice(rng.choice(groups)) for _ in range(num_prompts)]
        else:
            picked = [rng.choice(questions) for _ in range(num_prompts)]

    bos = getattr(tokenizer, "bos_id", None)
    rendered: dict[tuple[int, str, int], tuple[str, tuple[int, ...]]] = {}
    examples = []
    for i, (a, op, b, value) in enumerate(picked):
        if (a, op, b) not in rendered:
            text = format_prompt(
                tokenizer,
                question.format(a=a, op=op, b=b),
                template="chat",
                system_prompt=system_prompt,
                prompt_suffix=prompt_suffix,
            )
            ids = list(tokenizer.encode(text))
            if add_bos and bos is not None and ids[:1] != [bos]:
                ids.insert(0, bos)
            rendered[(a, op, b)] = text, tuple(ids)
        text, ids = rendered[(a, op, b)]
        examples.append(PromptExample(i, ids, text, str(value)))
    name = f"boxed arithmetic({ops}, {min_operand}..{max_operand}"
    if min_answer is not None or max_answer is not None:
        name += f", answers {min_answer}..{max_answer}"
    name += ", balanced" if balance_answers and num_prompts is not None else ""
    name += f", {split})"
    return PromptDataset(examples, name=name)
