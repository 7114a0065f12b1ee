"""Math answer extraction and normalisation on tricky cases."""

import pytest

from minippo.data import MathAnswerMatch, PromptExample, answers_match, extract_answer
from minippo.data.rewards import last_boxed, normalize_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last one
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"the value is \boxed 7 apples", "7"),
        ("Step 1 ...\n#### 1,234", "1,234"),
        ("work\n#### 5\nextra #### 6", "6"),
        ("So the answer is -3.", "-3"),  # the sentence's period is not part of the answer
        ("The final answer is: $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("lines\nAnswer: 17", "17"),
        (r"Answer: \boxed{9}", "9"),
        ("no answer here", None),
        (r"unclosed \boxed{12", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_fbox():
    assert last_boxed(r"\fbox{3}") == "3"


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("1,234,567", "1234567"),
        ("$18.00$", "18"),
        ("72.50", "72.5"),
        ("\u22125", "-5"),
        ("+4", "4"),
        ("25.", "25"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\text{5 apples}", "5apples"),
        ("x = 3", "3"),
        (r"45^\circ", "45"),
        (r"50\%", "50"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        ("(1, 234)", "(1,234)"),  # a tuple, not a thousands separator
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize(
    ("pred", "ref", "same"),
    [
        ("1,000", "1000", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"-\frac{3}{4}", "-0.75", True),
        ("5/3", r"\dfrac{5}{3}", True),
        ("$25$.", "25", True),
        ("-7", "7", False),
        ("3.14", "3.15", False),
        (r"\frac{1}{0}", "1", False),
        (r"\sqrt{2}", r"\sqrt{2}", True),
        ("12", "12.0", True),
    ],
)
def test_answers_match(pred, ref, same):
    assert answers_match(pred, ref) is same


def test_math_answer_match_reward():
    gsm = PromptExample(0, (1,), "q", "He has 84 - 59 = 25 left.\n#### 25")
    r = MathAnswerMatch()
    assert r(gsm, "84 - 59 = 25, so the answer is 25.") == 1.0
    assert r(gsm, r"We get \boxed{25}") == 1.0
    assert r(gsm, r"We get \boxed{24}") == 0.0
    assert r(gsm, "I think 25") == 0.0  # no extractable final answer
    dapo = PromptExample(1, (1,), "q", r"\frac{3}{4}")  # a bare reference answer
    assert r(dapo, "Answer: 0.75") == 1.0
    assert MathAnswerMatch(format_score=0.1)(dapo, r"\boxed{1}") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="format_score"):
        MathAnswerMatch(format_score=1.0)
