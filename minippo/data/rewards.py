"""Rewards: ``reward(example, completion) -> float`` for toy tasks and math answers.

A reward is a callable object (so that a config builds it with ``_component_``) that scores a
decoded completion (special tokens removed, cut at the stop token) against
``example.answer``. ``max_value`` is the best possible score (reports say "reward / max").

Math answers (:class:`MathAnswerMatch`): the final answer is extracted from the completion by
:func:`extract_answer` (the last ``\\boxed{...}``, else the last ``#### x`` line, else the last
``Answer: x`` / ``The answer is x``) and compared with the reference after
:func:`normalize_answer` (or numerically, when both sides are numbers).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any


class ExactMatch:
    """1.0 when the completion (outer whitespace stripped) equals the answer, else 0.0."""

    max_value = 1.0

    def __call__(self, example: Any, completion: str) -> float:
        return 1.0 if completion.strip() == example.answer.strip() else 0.0


class PerPositionMatch:
    """Partial credit per position: the fraction of answer positions the completion gets right.

    reward = Σ_i [c_i == a_i] / max(len(a), len(c))   (c = completion, a = answer, characters)

    A completion that is too long or too short loses the extra / missing positions, so the
    maximum 1.0 is reached only by the exact answer.
    """

    max_value = 1.0

    def __call__(self, example: Any, completion: str) -> float:
        a, c = example.answer, completion
        if not a and not c:
            return 1.0
        hits = sum(x == y for x, y in zip(a, c))
        return hits / max(len(a), len(c))


class MathAnswerMatch:
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    Args:
        format_score: reward for a completion whose answer can be extracted but is wrong
            (0.0 by default; a small value such as 0.1 rewards the answer format early on).
    """

    max_value = 1.0

    def __init__(self, format_score: float = 0.0) -> None:
        if not 0.0 <= format_score < 1.0:
            raise ValueError(f"format_score must be in [0, 1), got {format_score}")
        self.format_score = format_score

    def __call__(self, example: Any, completion: str) -> float:
        pred = extract_answer(completion)
        if pred is None:
            return 0.0
        ref = extract_answer(example.answer)
        if ref is None:
            ref = example.answer
        return 1.0 if answers_match(pred, ref) else self.format_score


# ----------------------------------------------------------------------------------------------
# extraction


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces respected.

    Also accepts the brace-less form ``\boxed 5``. None when there is none (or it is unclosed).
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # \boxed 5
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    j = _closing_brace(text, i)
    return None if j is None else text[i + 1 : j]


def _closing_brace(text: str, i: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``text[i]`` (nesting respected), or None."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(
    r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*([^\n]+)", flags=re.IGNORECASE
)
_ANSWER_COLON = re.compile(r"(?:^|\n)\s*\**answer\**\s*:\s*([^\n]+)", flags=re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    r"""The final answer written in ``text``, or None.

    Order: the last ``\boxed{...}``; the last ``#### x``; the last ``Answer: x`` line; the last
    ``The answer is x`` / ``final answer is x``. A sentence-ending period after the answer
    is dropped by :func:`normalize_answer`.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_COLON, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            ans = found[-1].strip()
            inner = last_boxed(ans)
            return inner.strip() if inner is not None else ans
    return None


# ----------------------------------------------------------------------------------------------
# normalisation and comparison


def _strip_command(s: str, cmd: str) -> str:
    r"""``\cmd{x}`` -> ``x`` (nested braces respected), for every occurrence."""
    out = s
    while True:
        k = out.find("\\" + cmd + "{")
        if k < 0:
            return out
        i = k + len(cmd) + 1
        j = _closing_brace(out, i)
        if j is None:
            return out
        out = out[:k] + out[i + 1 : j] + out[j + 1 :]


def normalize_answer(s: str) -> str:
    r"""A canonical string for an answer.

    * strip ``$...$``, ``\(...\)``, ``\[...\]``, ``\text{}``/``\mathrm{}``/``\mathbf{}`` wrappers,
      ``\left``/``\right``, ``\!``/``\,``/``\;`` spacing, ``^\circ``, ``%``, units-free;
    * ``\dfrac``/``\tfrac`` -> ``\frac``; ``\frac12`` -> ``\frac{1}{2}``;
    * unicode minus -> ``-``; a leading ``+`` and a trailing period are dropped;
    * thousands separators in numbers (``1,234,567`` -> ``1234567``), all spaces removed;
    * a leading ``x =`` (single-letter variable) is dropped;
    * numbers lose trailing zeros after the point (``72.50`` -> ``72.5``, ``3.0`` -> ``3``).
    """
    s = s.strip()
    s = s.replace("\u2212", "-").replace("\u2013", "-")
    for a, b in (("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", "")):
        s = s.replace(a, b)
    s = s.strip().strip("$").strip()
    s = s.rstrip(".").strip()
    for cmd in ("text", "textbf", "mathrm", "mathbf", "boxed"):
        s = _strip_command(s, cmd)
    s = s.replace("\\left", "").replace("\\right", "")
    for sp in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(sp, "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,234,567 -> 1234567
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # x = 5 -> 5
    s = s.replace(" ", "")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    if re.fullmatch(r"-?\d+\.\d*", s):  # 72.50 -> 72.5, 3.0 -> 3
        s = s.rstrip("0").rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    r"""``s`` (already normalised) as an exact number: ints, decimals, ``a/b``, ``\frac{a}{b}``,
    ``-\frac{a}{b}``; None otherwise."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if m:
        den = Fraction(m.group(3))
        if den == 0:
            return None
        v = Fraction(m.group(2)) / den
        return -v if m.group(1) else v
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
    if m:
        den = Fraction(m.group(2))
        return None if den == 0 else Fraction(m.group(1)) / den
    if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return Fraction(s)
    return None


def answers_match(pred: str, ref: str) -> bool:
    """True when two answers are the same after normalisation, or the same number exactly."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and x == y
