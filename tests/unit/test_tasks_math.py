r"""The boxed arithmetic task: prompts through the chat template, references that MathAnswerMatch
scores 1 when written ``\boxed{ans}`` and 0 otherwise, seeded draws, held-out splits, answer
balancing; TinyTokenizer's extra tokens."""

import collections
import re

import pytest

from minippo.data import MathAnswerMatch, format_prompt
from minippo.data.tasks import boxed_arithmetic_task
from minippo.models import TinyTokenizer

BOX = ["\\boxed{", "}"]


def test_extra_tokens_append_ids_and_merge_the_box():
    base = TinyTokenizer()
    tok = TinyTokenizer(extra_tokens=BOX)
    assert tok.vocab_size == base.vocab_size + 2 == 53
    assert tok.itos[: base.vocab_size] == base.itos  # the 51 ids of tiny_cpu do not move
    assert tok.encode("\\boxed{12}") == [51, 4, 5, 52]  # "\boxed{" is one id, like a BPE merge
    text = "x=\\boxed{7} or \\boxed{}."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("2+3=?") == base.encode("2+3=?")
    with pytest.raises(ValueError, match=r"'\\\\' at position 0"):
        tok.encode("\\box")  # only the whole "\boxed{" is in the vocabulary
    with pytest.raises(ValueError, match=re.escape("'{'")):
        base.encode("{")
    with pytest.raises(ValueError, match="extra_tokens must be a list"):
        TinyTokenizer(extra_tokens="\\boxed{")
    with pytest.raises(ValueError, match="already in the vocabulary"):
        TinyTokenizer(extra_tokens=["a"])
    with pytest.raises(ValueError, match="distinct non-empty"):
        TinyTokenizer(extra_tokens=["}", "}"])


def test_prompts_go_through_the_chat_template():
    tok = TinyTokenizer(extra_tokens=BOX)
    ds = boxed_arithmetic_task(
        tok, num_prompts=40, max_operand=3, prompt_suffix=" answer in \\boxed{}.", seed=1
    )
    for ex in ds:
        a, b = int(ex.prompt[0]), int(ex.prompt[2])
        assert ex.prompt == f"{a}+{b}=? answer in \\boxed{{}}.\n"  # TinyTokenizer's template
        assert ex.prompt == format_prompt(
            tok, f"{a}+{b}=?", template="chat", prompt_suffix=" answer in \\boxed{}."
        )
        assert ex.prompt_ids == (tok.bos_id, *tok.encode(ex.prompt))
        assert ex.answer == str(a + b)
    assert [e.index for e in ds] == list(range(40))


def test_reference_scores_one_only_when_boxed():
    tok = TinyTokenizer(extra_tokens=BOX)
    reward = MathAnswerMatch(format_score=0.1)
    strict = MathAnswerMatch(strict=True)
    ds = boxed_arithmetic_task(tok, num_prompts=None, max_operand=4, ops="+-*", min_answer=0)
    assert len(ds) == 3 * 25 - 10  # a - b < 0 dropped (10 of the 25 differences)
    for ex in ds:
        value = int(ex.answer)
        right = f"\\boxed{{{value}}}"
        assert tok.decode(tok.encode(right)) == right  # the model can write it
        assert reward(ex, right) == strict(ex, right) == 1.0
        assert reward(ex, f"\\boxed{{{value + 1}}}") == 0.1  # boxed but wrong: format_score
        assert strict(ex, f"\\boxed{{{value + 1}}}") == 0.0
        assert reward(ex, ex.answer) == strict(ex, ex.answer) == 0.0  # no box, no answer
        assert reward(ex, f"\\boxed{{{value}") == 0.0  # unclosed


def test_seeded_draws_splits_and_balance():
    tok = TinyTokenizer(extra_tokens=BOX)
    kw = dict(num_prompts=200, max_operand=3)
    a = boxed_arithmetic_task(tok, seed=3, **kw)
    assert [e.prompt for e in a] == [e.prompt for e in boxed_arithmetic_task(tok, seed=3, **kw)]
    assert [e.prompt for e in a] != [e.prompt for e in boxed_arithmetic_task(tok, seed=4, **kw)]

    # held out: round(0.25 x 16) = 4 questions in test, the other 12 in train, for any seed
    every = {e.prompt for e in boxed_arithmetic_task(tok, num_prompts=None, max_operand=3)}
    test = {e.prompt for e in boxed_arithmetic_task(tok, split="test", holdout=0.25, **kw)}
    train = {e.prompt for e in boxed_arithmetic_task(tok, split="train", holdout=0.25, **kw)}
    assert len(every) == 16 and len(test) == 4 and len(train) == 12
    assert test | train == every and not test & train
    other_seed = boxed_arithmetic_task(
        tok, num_prompts=None, split="test", holdout=0.25, max_operand=3, seed=9
    )
    assert {e.prompt for e in other_seed} == test
    moved = boxed_arithmetic_task(
        tok, num_prompts=None, split="test", holdout=0.25, max_operand=3, split_seed=1
    )
    assert {e.prompt for e in moved} != test

    # sums of 0..3: answer 3 has 4 of the 16 questions; balanced, every answer is drawn alike
    n = 7000
    plain = collections.Counter(
        e.answer for e in boxed_arithmetic_task(tok, num_prompts=n, max_operand=3)
    )
    balanced = collections.Counter(
        e.answer
        for e in boxed_arithmetic_task(tok, num_prompts=n, max_operand=3, balance_answers=True)
    )
    # binomial counts: mean n p, standard deviation sqrt(n p (1 - p)) = 29 (p = 1/7) and 36 (1/4)
    assert all(abs(balanced[str(v)] - n / 7) < 5 * 29 for v in range(7))
    assert abs(plain["3"] - n / 4) < 5 * 36 and abs(plain["0"] - n / 16) < 5 * 21


def test_bad_arguments_name_the_fix():
    tok = TinyTokenizer(extra_tokens=BOX)
    with pytest.raises(ValueError, match="ops must be"):
        boxed_arithmetic_task(tok, ops="/")
    with pytest.raises(ValueError, match="split must be one of"):
        boxed_arithmetic_task(tok, split="val")
    with pytest.raises(ValueError, match="needs holdout in"):
        boxed_arithmetic_task(tok, split="test")
    with pytest.raises(ValueError, match="holds questions out only with split=train or split=test"):
        boxed_arithmetic_task(tok, holdout=0.25)  # split=all would train on the test questions
    with pytest.raises(ValueError, match="num_prompts must be >= 1 or null"):
        boxed_arithmetic_task(tok, num_prompts=2.5)
    with pytest.raises(ValueError, match="leaves an empty test split"):
        boxed_arithmetic_task(tok, split="test", holdout=0.01, max_operand=1)
    with pytest.raises(ValueError, match=re.escape("only {a}, {op} and {b}")):
        boxed_arithmetic_task(tok, question="{x}+{b}")
    with pytest.raises(ValueError, match="raise max_answer"):
        boxed_arithmetic_task(tok, min_operand=5, max_answer=3)
    with pytest.raises(ValueError, match="cannot encode character"):
        boxed_arithmetic_task(TinyTokenizer(), prompt_suffix=" answer in \\boxed{}.")
