"""MathAnswerMatch on completions written in each format class: right -> 1, wrong -> 0."""

import pytest

from minippo.data import MathAnswerMatch, PromptExample, extract_answer
from minippo.data.rewards import reference_answer

GSM8K_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 18"


def ex(answer: str) -> PromptExample:
    return PromptExample(0, (1,), "q", answer)


# (format class, a completion stating 18, the same completion stating 17)
GSM8K_FORMATS = [
    ("boxed", r"So she has \boxed{18}.", r"So she has \boxed{17}."),
    ("boxed with a text unit", r"\boxed{18 \text{ dollars}}", r"\boxed{17 \text{ dollars}}"),
    ("boxed in math mode", r"The total is $\boxed{18}$.", r"The total is $\boxed{17}$."),
    ("hashes", "9 * 2 = 18\n#### 18", "9 * 2 = 17\n#### 17"),
    ("hashes with a currency sign", "#### $18", "#### $17"),
    ("hashes with a unit", "#### 18 dollars", "#### 17 dollars"),
    (
        "Minerva",
        "9 + 9 = 18.\nFinal Answer: The final answer is $18$. I hope it is correct.",
        "9 + 8 = 17.\nFinal Answer: The final answer is $17$. I hope it is correct.",
    ),
    (
        "Minerva without math mode",
        "Final Answer: The final answer is 18. I hope it is correct.",
        "Final Answer: The final answer is 17. I hope it is correct.",
    ),
    ("bold Answer", "Work: 9 + 9.\n\n**Answer:** 18", "Work: 9 + 8.\n\n**Answer:** 17"),
    ("bold Final Answer", "**Final Answer:** 18", "**Final Answer:** 17"),
    ("bold outside the colon", "**Answer**: 18", "**Answer**: 17"),
    ("Answer line", "Some work\nAnswer: 18", "Some work\nAnswer: 17"),
    ("the answer is", "The answer is 18.", "The answer is 17."),
    ("the answer is, bold", "So the answer is **18**.", "So the answer is **17**."),
    ("trailing zeros", "The answer is 18.00", "The answer is 17.00"),
    ("decimal point", r"\boxed{18.0}", r"\boxed{17.5}"),
    (
        "last of several boxes",
        r"\boxed{17} is wrong; \boxed{18}",
        r"\boxed{18} is wrong; \boxed{17}",
    ),
    ("latex spacing", r"\boxed{\$18}", r"\boxed{\$17}"),
    ("variable assignment", r"\boxed{x = 18}", r"\boxed{x = 17}"),
    ("marker then prose", "#### 18\nThis answer is correct.", "#### 17\nThis answer is correct."),
]


@pytest.mark.parametrize(
    ("name", "right", "wrong"), GSM8K_FORMATS, ids=[f[0] for f in GSM8K_FORMATS]
)
def test_gsm8k_reference_formats(name, right, wrong):
    reward = MathAnswerMatch()
    assert reward(ex(GSM8K_REF), right) == 1.0, name
    assert reward(ex(GSM8K_REF), wrong) == 0.0, name
    assert reward(ex("18"), right) == 1.0, name  # a bare reference (DAPO-Math)


def test_thousands_separators():
    reward = MathAnswerMatch()
    for right in (r"\boxed{1,000}", "#### 1,000", "The answer is 1000.", r"\boxed{1{,}000}"):
        assert reward(ex("#### 1000"), right) == 1.0, right
    assert reward(ex("1,000"), r"\boxed{1000}") == 1.0
    assert reward(ex("#### 1000"), r"\boxed{1,001}") == 0.0
    assert reward(ex("#### 1234567"), "#### 1,234,567") == 1.0


# MATH / DAPO answers that need math-verify: (reference, equivalent forms, wrong forms)
MATH_CLASSES = [
    (
        "fraction",
        r"\frac{3}{4}",
        [r"\dfrac{3}{4}", "0.75", "3/4", r"\frac{6}{8}"],
        [r"\frac{4}{3}"],
    ),
    ("root", r"\frac{\sqrt{3}}{2}", [r"\frac{1}{2}\sqrt{3}", r"\sqrt{3}/2"], [r"\sqrt{3}"]),
    ("pi", r"\frac{\pi}{2}", [r"\pi/2", r"\frac{1}{2}\pi"], [r"\pi"]),
    ("set", r"\{1, 2, 3\}", [r"\{3, 2, 1\}"], [r"\{1, 2\}"]),
    ("interval", r"(-\infty, 3]", [r"(-\infty,3]"], [r"(-\infty, 3)"]),
    ("tuple", r"(2, -1)", [r"(2,-1)"], [r"(-1, 2)"]),
    ("expression", r"x^2 + 2x + 1", [r"(x+1)^2", r"1 + 2x + x^2"], [r"x^2 + 1"]),
    ("equation", "5", ["x = 5", "x=5"], ["x = 6"]),
    ("percent", r"50\%", ["0.5", "50"], ["0.6"]),
    ("negative", "-7", [r"-7", r"\boxed{-7}"], ["7"]),
    ("degrees", r"45^\circ", ["45", r"45^{\circ}"], ["90"]),
    (
        "plain text unit after a fraction",
        r"\frac{1}{2}",
        [r"\frac{1}{2} cup"],
        [r"\frac{1}{3} cup"],
    ),
    ("decimal", "2.5", [r"\frac{5}{2}", "2.50"], ["2.4"]),
]


@pytest.mark.parametrize(
    ("name", "ref", "rights", "wrongs"), MATH_CLASSES, ids=[c[0] for c in MATH_CLASSES]
)
def test_math_verify_classes(name, ref, rights, wrongs):
    reward = MathAnswerMatch()
    solution = f"We compute ... and get $\\boxed{{{ref}}}$."  # a MATH solution as the reference
    for example in (ex(ref), ex(solution)):
        for right in rights:
            assert reward(example, f"Thus the answer is $\\boxed{{{right}}}$.") == 1.0, right
            assert reward(example, f"Final Answer: The final answer is ${right}$. I hope") == 1.0
        for wrong in wrongs:
            assert reward(example, f"\\boxed{{{wrong}}}") == 0.0, wrong


def test_references_gsm8k_math_and_plain():
    assert reference_answer(GSM8K_REF) == "18"
    assert reference_answer(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert reference_answer(r" \frac{3}{4} ") == r"\frac{3}{4}"
    assert reference_answer("34") == "34"


def test_no_answer_format_score_and_penalty():
    r = MathAnswerMatch()
    assert r(ex("#### 18"), "I think it is 18") == 0.0  # no final-answer marker
    assert r(ex("#### 18"), r"\boxed{18") == 0.0  # unclosed box, nothing else
    scored = MathAnswerMatch(format_score=0.1, format_penalty=0.5)
    assert scored(ex("#### 18"), r"\boxed{17}") == pytest.approx(0.1)
    assert scored(ex("#### 18"), r"\boxed{18}") == 1.0
    assert scored(ex("#### 18"), "no idea") == -0.5
    with pytest.raises(ValueError, match="format_penalty"):
        MathAnswerMatch(format_penalty=-1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathAnswerMatch(timeout_s=0)


def test_strict_mode_reads_only_answer_lines_and_boxes():
    strict = MathAnswerMatch(strict=True, format_penalty=1.0)
    ref = ex("18")
    assert strict(ref, "work\nAnswer: 18") == 1.0
    assert strict(ref, "work\n**Answer:** 18") == 1.0
    assert strict(ref, r"work, so \boxed{18}") == 1.0
    assert strict(ref, "Final Answer: The final answer is $18$. I hope it is correct.") == 1.0
    assert strict(ref, "work\nAnswer: 17") == 0.0
    assert strict(ref, "#### 18") == -1.0  # not a DAPO answer line
    assert strict(ref, "The answer is 18.") == -1.0
    # the last of "Answer:" and the box counts
    assert strict(ref, "Answer: 17\nActually \\boxed{18}") == 1.0
    assert strict(ref, "\\boxed{18}\nAnswer: 17") == 0.0
    assert extract_answer("Answer: 3\nAnswer: 4", strict=True) == "4"
