r"""A quick numeric check of two LaTeX answers, tried before math-verify.

math-verify parses LaTeX with an ANTLR grammar run in pure Python: 5-80 ms per new answer on a
CPU core, most of a math reward's time. Most answers to math problems are small expressions that
Python can evaluate directly: ``3\sqrt{5}``, ``\frac{3\pi}{4}``, ``x^2 + 2x + 1``, a tuple or an
interval of such. :func:`numeric_verdict` evaluates both answers (at four fixed rational points
for each variable) and decides:

* while only rationals are involved (integers, fractions, polynomials and rational functions at
  rational points) the values are exact ``Fraction`` s: equal or not, exactly;
* after a root or pi they are floats: equal when they agree to 1e-9, not equal when they differ by
  more than 1e-6 (relative to their size); in between it does not decide.

Anything it does not decide, or any answer outside the small grammar below, returns None and goes
to math-verify.

Grammar (anything else returns None): integers, ``\pi``, single-letter variables (not ``e``/``i``:
math-verify may read them as constants), ``+ - * /``, ``\cdot``, ``\times``, implicit products,
``^`` with a braced or one-character exponent, ``\frac{a}{b}`` (``\dfrac``, ``\tfrac``,
``\frac12``), ``\sqrt{x}``, ``\sqrt[n]{x}``, parentheses and braces; at the top level a list in
the same brackets on both sides (``(a, b]``, ``(x, y)``) whose elements may be ``\pm\infty``,
or in different brackets as intervals (``(1, 2]`` vs ``[1, 2]``); a set ``\{a, b\}`` of exact
rationals; an equation ``y = ...`` against one with the same variable on the left. Decimals
(math-verify rounds them to 6 places), percentages, degrees, units, other equations and text all
go to math-verify. Integer powers above 64 go to math-verify too (its deadline guards
against ``2^{10^9}``). tests/unit/test_rewards_properties.py checks that every verdict is
math-verify's.
"""

from __future__ import annotations

import math
import random
import re
import string
from fractions import Fraction

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<cmd>\\[A-Za-z]+|\\[,;:! {}])|(?P<var>[A-Za-z])|(?P<op>[-+*/^(){}\[\],=]))"
)
_SPACING = {"\\,", "\\;", "\\:", "\\!", "\\ ", "\\left", "\\right", "\\displaystyle"}
_N_POINTS = 4  # evaluations of an expression with variables
_rng = random.Random(20240917)
# the value of each possible variable at each evaluation point: rationals in [0.5, 2.5] drawn once
_POINTS = [
    {
        v: Fraction(_rng.randint(500, 2500), _rng.choice([997, 1009, 1013]))
        for v in string.ascii_letters
    }
    for _ in range(_N_POINTS)
]
_MAX_EXPONENT = 64  # larger integer powers are left to math-verify (and its deadline)
_MAX_BITS = 1 << 14  # so are exact powers with more bits than this
_EQUAL_RTOL = 1e-9
_DIFFERENT_RTOL = 1e-6


Value = Fraction | float  # exact while only rationals are involved; float after a root or pi


class _Unsupported(Exception):
    """The answer is outside the grammar: math-verify decides."""


def _tokens(s: str) -> list[str]:
    out, i = [], 0
    s = s.strip()
    while i < len(s):
        m = _TOKEN.match(s, i)
        if m is None or m.end() == i:
            raise _Unsupported(s[i:])
        i = m.end()
        tok = m.group(m.lastgroup)
        if tok in _SPACING:
            continue
        out.append(tok)
    return out


class _Parser:
    """Recursive descent over the tokens, evaluating at one point ``env`` (variable -> value)."""

    def __init__(self, tokens: list[str], env: dict[str, float]) -> None:
        self.toks, self.i, self.env = tokens, 0, env

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unsupported(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def expr(self) -> Value:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def _starts_atom(self, tok: str | None) -> bool:
        if tok is None:
            return False
        return (
            tok[0].isdigit()
            or (len(tok) == 1 and tok.isalpha())
            or tok in ("(", "{", "\\pi", "\\frac", "\\dfrac", "\\tfrac", "\\sqrt")
        )

    def term(self) -> Value:
        value = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times"):
                self.take()
                value *= self.unary()
            elif tok == "/":
                self.take()
                den = self.power()
                if self._starts_atom(self.peek()):  # "1/2x": (1/2)x or 1/(2x)? math-verify decides
                    raise _Unsupported("implicit product after '/'")
                value /= den
            elif self._starts_atom(tok):
                if tok[0].isdigit() and self.toks[self.i - 1][0].isdigit():
                    raise _Unsupported("two numbers side by side")
                value *= self.power()
            else:
                return value

    def unary(self) -> Value:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power()

    def power(self) -> Value:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        tok = self.peek()
        if tok == "{":
            exponent = self.group()
        elif tok is not None and (len(tok) == 1 and (tok.isdigit() or tok.isalpha())):
            exponent = self.atom()
        else:  # x^10 is x^1 0 in LaTeX, x^-1 is not LaTeX: math-verify decides
            raise _Unsupported(f"exponent {tok!r}")
        if self.peek() == "^":
            raise _Unsupported("a^b^c")
        if isinstance(exponent, Fraction) and exponent.denominator == 1:
            if abs(exponent) > _MAX_EXPONENT:
                raise _Unsupported("a large power")
            if isinstance(base, Fraction):
                bits = max(base.numerator.bit_length(), base.denominator.bit_length())
                if bits * abs(exponent) > _MAX_BITS:  # {{2^{64}}^{64}}^{64}...
                    raise _Unsupported("a huge power")
            return base ** int(exponent)  # exact for a rational base
        return float(base) ** float(exponent)

    def group(self) -> Value:
        self.take("{")
        value = self.expr()
        self.take("}")
        return value

    def atom(self) -> Value:
        tok = self.take()
        if tok[0].isdigit():
            if "." in tok:
                raise _Unsupported("a decimal")
            return Fraction(int(tok))
        if len(tok) == 1 and tok.isalpha():
            if tok in "eEiI":
                raise _Unsupported(f"variable {tok!r}")
            return self.env[tok]
        if tok == "\\pi":
            return math.pi
        if tok == "(":
            value = self.expr()
            self.take(")")
            return value
        if tok == "{":
            self.i -= 1
            return self.group()
        if tok in ("\\frac", "\\dfrac", "\\tfrac"):
            if self.peek() is not None and self.peek()[0].isdigit() and self.peek() != "{":
                digits = self.take()  # \frac12 -> 1/2
                if len(digits) != 2 or "." in digits:
                    raise _Unsupported("\\frac with digits")
                return Fraction(int(digits[0]), int(digits[1]))
            num = self.group()
            return num / self.group()
        if tok == "\\sqrt":
            root: Value = 2
            if self.peek() == "[":
                self.take("[")
                root = self.expr()
                self.take("]")
            radicand = self.group()
            if radicand < 0:
                raise _Unsupported("sqrt of a negative number")
            return float(radicand) ** (1.0 / float(root))
        raise _Unsupported(tok)


def _variables(tokens: list[str]) -> list[str]:
    return sorted({t for t in tokens if len(t) == 1 and t.isalpha()})


def _evaluate(tokens: list[str], variables: list[str]) -> list[Value]:
    """The expression's value at each point (one value when no answer has a variable)."""
    values = []
    for k in range(_N_POINTS if variables else 1):
        p = _Parser(tokens, _POINTS[k])
        value = p.expr()
        if p.peek() is not None:
            raise _Unsupported(f"trailing {p.peek()!r}")
        if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
            raise _Unsupported("not a finite real number")
        values.append(value)
    return values


def _split_list(tokens: list[str]) -> tuple[str, list[list[str]], str] | None:
    r"""(open, elements, close) of a top-level ``(a, b]``-style list or ``\{a, b\}`` set, or
    None."""
    is_set = tokens[:1] == ["\\{"] and tokens[-1:] == ["\\}"]
    if len(tokens) < 2 or not (is_set or (tokens[0] in ("(", "[") and tokens[-1] in (")", "]"))):
        return None
    elements, current, depth = [], [], 0
    for tok in tokens[1:-1]:
        if tok in ("(", "[", "{"):
            depth += 1
        elif tok in (")", "]", "}"):
            depth -= 1
            if depth < 0:
                return None  # "(1)+(2)": not one list
        if tok == "," and depth == 0:
            elements.append(current)
            current = []
        else:
            current.append(tok)
    elements.append(current)
    if depth != 0 or (len(elements) < 2 and not is_set):
        return None
    return tokens[0], elements, tokens[-1]


def _element(tokens: list[str], variables: list[str]) -> list[Value]:
    if tokens in (["\\infty"], ["+", "\\infty"]):
        return [math.inf]
    if tokens == ["-", "\\infty"]:
        return [-math.inf]
    return _evaluate(tokens, variables)


def _compare(a: list[Value], b: list[Value]) -> bool | None:
    if len(a) != len(b):
        return None
    verdict = True
    for x, y in zip(a, b):
        if isinstance(x, Fraction) and isinstance(y, Fraction):  # exact
            if x != y:
                return False
            continue
        if math.isinf(x) or math.isinf(y):
            if x != y:
                return False
            continue
        scale = max(1.0, abs(x), abs(y))
        diff = abs(x - y)
        if diff > _DIFFERENT_RTOL * scale:
            return False
        if diff > _EQUAL_RTOL * scale:
            verdict = None  # too close to call
    return verdict


def _intervals(
    g: tuple[str, list[list[str]], str], p: tuple[str, list[list[str]], str], variables: list[str]
) -> bool | None:
    """Two-element lists in different brackets, such as ``(1, 2]`` and ``[1, 2]``: as intervals
    (math-verify reads them so when the lower end is below the upper one) they are the same set
    when their ends are equal and each finite end has the same bracket (an infinite end is open
    whatever its bracket)."""
    if variables or len(g[1]) != 2:
        return None
    ends = []
    for _, elements, _ in (g, p):
        lo, hi = (_element(e, variables)[0] for e in elements)
        if not lo < hi:
            return None  # not an interval: a point, or math-verify's empty set
        ends.append((lo, hi))
    verdict = _compare(list(ends[0]), list(ends[1]))
    if verdict is not True:
        return verdict
    lo, hi = ends[0]
    same_left = g[0] == p[0] or math.isinf(lo)
    same_right = g[2] == p[2] or math.isinf(hi)
    return same_left and same_right


def _sets(g: list[list[str]], p: list[list[str]], variables: list[str]) -> bool | None:
    r"""``\{a, b\}`` against ``\{c, d\}``: the same set of values (order and repeats do not
    matter), decided only when every element is an exact rational."""
    if variables:
        return None
    values = []
    for elements in (g, p):
        vals = [_evaluate(e, variables)[0] for e in elements]
        if not all(isinstance(v, Fraction) for v in vals):
            return None
        values.append(set(vals))
    return values[0] == values[1]


def _equations(g: list[str], p: list[str]) -> bool | None:
    """``y = 2x + 1`` against ``y = 1 + 2x``: the same variable on the left, and the right sides
    compared as expressions. Anything else with an ``=`` is math-verify's."""
    if g.count("=") != 1 or p.count("=") != 1:
        return None
    gl, gr = g[: g.index("=")], g[g.index("=") + 1 :]
    pl, pr = p[: p.index("=")], p[p.index("=") + 1 :]
    if gl != pl or len(gl) != 1 or not (gl[0].isalpha() and len(gl[0]) == 1) or not gr or not pr:
        return None
    return _verdict(gr, pr)


def numeric_verdict(gold: str, pred: str) -> bool | None:
    """True / False when both answers are in the grammar and their values decide; else None."""
    try:
        return _verdict(_tokens(gold), _tokens(pred))
    except _Unsupported:
        return None


def _verdict(g: list[str], p: list[str]) -> bool | None:
    try:
        if not g or not p:
            return None
        if "=" in g or "=" in p:
            return _equations(g, p)
        variables = _variables(g + p)
        gl, pl = _split_list(g), _split_list(p)
        if gl is None and pl is None:
            return _compare(_evaluate(g, variables), _evaluate(p, variables))
        if gl is None or pl is None:
            return None  # a list against a scalar: math-verify decides
        if "\\{" in (gl[0], pl[0]):
            return _sets(gl[1], pl[1], variables) if gl[0] == pl[0] else None
        if len(gl[1]) != len(pl[1]):
            return None
        if (gl[0], gl[2]) != (pl[0], pl[2]):
            return _intervals(gl, pl, variables)
        verdict: bool | None = True
        for ge, pe in zip(gl[1], pl[1]):
            v = _compare(_element(ge, variables), _element(pe, variables))
            if v is False:
                return False
            if v is None:
                verdict = None
        return verdict
    except (_Unsupported, ArithmeticError, ValueError, OverflowError):
        return None
