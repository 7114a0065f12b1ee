"""Properties of MathAnswerMatch over seeded random completions: a right answer never scores 0
(in any format, after any reasoning text), a wrong one never scores 1, and the fast number path
decides exactly as math-verify would."""

import random
from fractions import Fraction

import pytest
from math_verify import parse, verify

from minippo.data import MathAnswerMatch, PromptExample, answers_match

N_CASES = 400


def _filler(rng: random.Random) -> str:
    """Reasoning text with numbers and equations, but no final-answer marker."""
    parts = []
    for _ in range(rng.randint(0, 4)):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        parts.append(
            rng.choice(
                [
                    f"First, {a} + {b} = {a + b}.",
                    f"Then $\\frac{{{a}}}{{{b}}}$ of it is left.",
                    f"We have {a} apples and {b} boxes, so {a} * {b} = {a * b}.",
                    f"Let $x = {a}$, then $2x = {2 * a}$.",
                    "Let's check the work carefully.",
                ]
            )
        )
    return rng.choice([" ", "\n", "\n\n"]).join(parts)


def _number_forms(v: Fraction, rng: random.Random) -> list[str]:
    """Ways to write the value v inside a final answer."""
    if v.denominator == 1:
        n = int(v)
        forms = [str(n), f"{n:,}", f"{n}.00", f"{n}.0"]
        if n >= 0:
            forms += [f"\\${n}", f"{n} \\text{{ dollars}}", f"\\$\\,{n:,}"]
        return forms
    p, q = v.numerator, v.denominator
    forms = [f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}"]
    if p < 0:
        forms.append(f"-\\frac{{{-p}}}{{{q}}}")
    k = rng.randint(2, 5)
    forms.append(f"\\frac{{{p * k}}}{{{q * k}}}")  # not in lowest terms
    if (v * 10**6).denominator == 1:  # a terminating decimal
        forms.append(str(float(v)))
    return forms


FORMATS = [
    "\\boxed{{{a}}}",
    "So the total is $\\boxed{{{a}}}$.",
    "#### {a}",
    "The answer is {a}.",
    "The answer is ${a}$.",
    "**Answer:** {a}",
    "**Final Answer:** {a}",
    "Answer: {a}",
    "Final Answer: The final answer is ${a}$. I hope it is correct.",
    "\\boxed{{0}} was a slip; the answer is \\boxed{{{a}}}",
]


def _value(rng: random.Random) -> Fraction:
    if rng.random() < 0.6:
        return Fraction(rng.choice([rng.randint(-50, 50), rng.randint(0, 10**7)]))
    return Fraction(rng.randint(-99, 99), rng.randint(2, 40))


def _reference(v: Fraction, rng: random.Random) -> str:
    text = f"\\frac{{{v.numerator}}}{{{v.denominator}}}" if v.denominator != 1 else str(int(v))
    return rng.choice(
        [
            text,  # a bare answer (DAPO-Math)
            f"Some steps <<1+1=2>>.\n#### {text}",  # GSM8K
            f"Hence the answer is $\\boxed{{{text}}}$.",  # a MATH solution
        ]
    )


def _cases(seed: int):
    rng = random.Random(seed)
    for _ in range(N_CASES):
        v = _value(rng)
        wrong = v + rng.choice([1, -1, Fraction(1, 2), 10, -7])
        fmt = rng.choice(FORMATS)
        filler = _filler(rng)
        right = filler + "\n" + fmt.format(a=rng.choice(_number_forms(v, rng)))
        bad = filler + "\n" + fmt.format(a=rng.choice(_number_forms(wrong, rng)))
        yield PromptExample(0, (1,), "q", _reference(v, rng)), right, bad


@pytest.mark.parametrize("seed", [0, 1])
def test_a_right_answer_never_scores_0_and_a_wrong_one_never_1(seed):
    reward = MathAnswerMatch()
    for example, right, wrong in _cases(seed):
        assert reward(example, right) == 1.0, (example.answer, right)
        assert reward(example, wrong) == 0.0, (example.answer, wrong)


def test_strict_mode_right_answer_lines_score_1():
    reward = MathAnswerMatch(strict=True)
    rng = random.Random(7)
    for _ in range(200):
        v = _value(rng)
        a = rng.choice(_number_forms(v, rng))
        fmt = rng.choice(["Answer: {a}", "**Answer:** {a}", "\\boxed{{{a}}}", "Answer: ${a}$"])
        completion = _filler(rng) + "\n" + fmt.format(a=a)
        assert reward(PromptExample(0, (1,), "q", _reference(v, rng)), completion) == 1.0


def _plain_forms(v: Fraction) -> list[str]:
    """Plain numbers math-verify parses the same way we do (no unit words)."""
    if v.denominator == 1:
        return [str(int(v)), f"{int(v):,}", f"{int(v)}.00"]
    forms = [f"\\frac{{{v.numerator}}}{{{v.denominator}}}", f"{v.numerator}/{v.denominator}"]
    if (v * 10**6).denominator == 1:
        forms.append(str(float(v)))
    return forms


def test_the_number_fast_path_agrees_with_math_verify():
    """answers_match decides plain numbers in Python; math-verify (run here, in the main thread)
    must give the same verdict on every pair, percentages and 7-decimal roundings included."""

    def verdict(pred: str, ref: str) -> bool:
        return verify(parse(f"${ref}$"), parse(f"${pred}$"))

    rng = random.Random(3)
    pairs = [("50\\%", "0.5"), ("0.5", "50\\%"), ("50\\%", "50"), ("18.0000001", "18")]
    pairs += [("0.333333", "\\frac{1}{3}"), ("0.33", "\\frac{1}{3}"), ("1,000", "1000")]
    for _ in range(150):
        v = _value(rng)
        w = rng.choice([v, v + 1, v * 2, -v, v + Fraction(1, 10**7)])
        pairs.append((rng.choice(_plain_forms(w)), rng.choice(_plain_forms(v))))
    for pred, ref in pairs:
        assert answers_match(pred, ref) == verdict(pred, ref), (pred, ref)


def _expression_pairs(rng: random.Random) -> list[tuple[str, str]]:
    """(reference, answer) pairs of LaTeX expressions, equivalent or not."""
    a, b, c = rng.randint(2, 30), rng.choice([2, 3, 5, 6, 7, 10, 11]), rng.randint(2, 30)
    return [
        (f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}"),
        (f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{b}}} \\cdot {a}"),
        (f"{a}\\sqrt{{{b}}}", f"{a + 1}\\sqrt{{{b}}}"),
        (f"\\frac{{{a}\\pi}}{{{c}}}", f"\\frac{{{a}}}{{{c}}}\\pi"),
        (f"\\frac{{{a}\\pi}}{{{c}}}", f"{a}\\pi/{c}"),
        (f"\\frac{{{a}\\pi}}{{{c}}}", f"\\frac{{{a + 1}\\pi}}{{{c}}}"),
        (f"x^2 + {a}x + {c}", f"{c} + {a}x + x^{{2}}"),
        (f"x^2 + {a}x + {c}", f"x^2 + {a + 1}x + {c}"),
        (f"(x+{a})^2", f"x^2 + {2 * a}x + {a * a}"),
        (f"\\frac{{x+{a}}}{{x-{c}}}", f"1 + \\frac{{{a + c}}}{{x-{c}}}"),
        (f"(-{a}, {c}]", f"\\left(-{a},{c}\\right]"),
        (f"(-{a}, {c}]", f"(-{a}, {c + 1}]"),
        (f"(-{a}, {c}]", f"[-{a}, {c}]"),
        (f"[-{a}, {c})", f"[-{a}, {c}]"),
        (f"(-\\infty, {c}]", f"[-\\infty, {c}]"),
        (f"({a}, \\infty)", f"({a}, \\infty]"),
        (f"(1, 2, {c})", f"[1, 2, {c}]"),
        (f"(-\\infty, {c})", f"(-\\infty,{c})"),
        (f"({a}, -{c})", f"(-{c}, {a})"),
        (f"{a}x", f"{a}y"),
        (f"\\sqrt[3]{{{a**3}}}", f"{a}"),
        (f"\\frac{{{a}}}{{{c}}}", f"\\dfrac{{{2 * a}}}{{{2 * c}}}"),
        (f"\\{{{a}, {c}, 1\\}}", f"\\{{1, {c}, {a}, {a}\\}}"),
        (f"\\{{{a}, {c}\\}}", f"\\{{{a}, {c + 1}\\}}"),
        (f"\\{{{a}, {c}\\}}", f"\\{{{a}\\}}"),
        (f"y = {a}x + {c}", f"y = {c} + {a}x"),
        (f"y = {a}x + {c}", f"y = {a}x + {c + 1}"),
    ]


def test_the_numeric_check_agrees_with_math_verify():
    """Expressions are decided by evaluating them in Python (minippo.data._numeric) when they are
    simple; that verdict must be math-verify's on every pair it decides, and it must decide most
    of these (else the check is pointless)."""
    from minippo.data._numeric import numeric_verdict

    rng = random.Random(5)
    decided = total = 0
    for _ in range(12):
        for ref, pred in _expression_pairs(rng):
            total += 1
            ours = numeric_verdict(ref, pred)
            if ours is None:
                continue
            decided += 1
            assert ours == verify(parse(f"${ref}$"), parse(f"${pred}$")), (ref, pred)
    assert decided >= 0.9 * total
