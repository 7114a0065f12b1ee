"""Rewards: ``reward(example, completion) -> float`` for toy tasks and math answers.

A reward is a callable object (so that a config builds it with ``_component_``) that scores a
decoded completion (special tokens removed, cut at the stop token) against
``example.answer``. ``max_value`` is the best possible score (reports say "reward / max").

Math answers (:class:`MathAnswerMatch`) go in two steps:

1. **Extraction** (:func:`extract_answer`): the final answer the completion states, as a string:
   the last ``\\boxed{...}``, else the answer after the last marker (``#### x``, ``Answer: x``,
   ``**Final Answer:** x``, ``The answer is x``, Minerva's ``Final Answer: The final answer is
   $x$. I hope it is correct.``), cut to the math (``$...$``) or to the end of the sentence.
   Strict mode (DAPO-style) reads only the last ``Answer:`` line or the last ``\\boxed{}``.
2. **Equivalence** (:func:`answers_match`): `math-verify
   <https://github.com/huggingface/Math-Verify>`_'s ``verify(parse(ref), parse(pred))``
   (fractions, roots, sets, intervals, equations, units), run in a child process
   (:class:`MathVerifier`) so that each call has a deadline in any thread. Two fast paths give
   math-verify's verdict without its LaTeX parser (5-80 ms per new answer): plain numbers
   (``1,000``, ``$18``, ``18.00``, ``18 dollars``, ``\\frac{3}{4}``, ``50\\%``) compared exactly,
   and small expressions evaluated in Python (``minippo.data._numeric``: ``3\\sqrt{5}``,
   ``x^2 + 2x + 1``, ``(-3, 4]``, ``\\{1, 2\\}``, ``y = 2x + 1``). Whatever they cannot decide
   goes to math-verify.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from minippo.data._numeric import numeric_verdict

log = logging.getLogger(__name__)


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
    r"""1.0 when the completion's final answer equals the reference answer.

    reward = 1.0             the extracted answer is equivalent to the reference
             format_score    an answer was extracted but it is not equivalent (or timed out)
             -format_penalty no final answer could be extracted (strict: no ``Answer:`` line
                             and no ``\boxed{}``)

    The reference is ``example.answer``: a GSM8K solution (``... #### 72``), a MATH solution
    (its last ``\boxed{}``) or a bare answer (``72``, ``\frac{3}{4}``, as in DAPO-Math); it is
    extracted and checked once per distinct string (cached).

    Args:
        format_score: reward for a completion whose answer can be extracted but is wrong
            (0.0 by default; a small value such as 0.1 rewards the answer format early on).
        strict: DAPO-style: only the last ``Answer: x`` line or the last ``\boxed{x}`` counts
            (``#### x`` and "the answer is x" do not).
        format_penalty: subtracted when no final answer is found (reward ``-format_penalty``);
            0.0 by default.
        timeout_s: the deadline of one math-verify call (parse + compare); an answer whose check
            runs past it scores as wrong (``format_score``) and a warning is logged.
    """

    max_value = 1.0

    def __init__(
        self,
        format_score: float = 0.0,
        *,
        strict: bool = False,
        format_penalty: float = 0.0,
        timeout_s: float = 5.0,
    ) -> None:
        if not 0.0 <= format_score < 1.0:
            raise ValueError(
                f"reward.format_score must be in [0, 1), got {format_score}; e.g. 0.0 or 0.1"
            )
        if format_penalty < 0.0:
            raise ValueError(
                f"reward.format_penalty must be >= 0 (the reward is -format_penalty), "
                f"got {format_penalty}"
            )
        if not timeout_s > 0.0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {timeout_s}")
        self.format_score = float(format_score)
        self.strict = bool(strict)
        self.format_penalty = float(format_penalty)
        self.timeout_s = float(timeout_s)

    def __call__(self, example: Any, completion: str) -> float:
        pred = extract_answer(completion, strict=self.strict)
        if pred is None:
            return 0.0 - self.format_penalty  # 0.0, not -0.0, without a penalty
        ref = reference_answer(example.answer)
        same = answers_match(pred, ref, timeout_s=self.timeout_s)
        return 1.0 if same else self.format_score


# ----------------------------------------------------------------------------------------------
# extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)")


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


def _boxed_at(text: str, start: int) -> str | None:
    r"""The content of the ``\boxed{...}`` / ``\fbox{...}`` starting at ``text[start]`` (also the
    brace-less ``\boxed 5``); None when unclosed or empty."""
    base = start + (6 if text.startswith("\\boxed", start) else 5)
    i = base
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # \boxed 5
        if i == base and text[i].isalpha():  # \boxedx is another command, not a box
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    j = _closing_brace(text, i)
    if j is None:
        return None
    content = text[i + 1 : j].strip()
    return content or None


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last closed, non-empty box in ``text``."""
    for m in reversed(list(_BOXED.finditer(text))):
        content = _boxed_at(text, m.start())
        if content is not None:
            return m.start(), content
    return None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), nested braces respected.

    Also accepts the brace-less form ``\boxed 5``. Empty and unclosed boxes are skipped; None
    when there is none.
    """
    found = _last_boxed(text)
    return None if found is None else found[1]


# "#### x" | "Answer: x" / "**Answer:** x" / "**Final Answer:** x" / "Answer**: x" |
# "the answer is x" / "The final answer is x"
_MARKER = re.compile(
    r"####|\b(?:final\s+)?answer\s*(?:\*\*)?\s*:|\b(?:final\s+)?answer\s+is\b", re.IGNORECASE
)
_STRICT_MARKER = re.compile(r"\banswer\s*(?:\*\*)?\s*:", re.IGNORECASE)
_LEAD = re.compile(r"^[\s*_:]*(?:(?:the\s+)?(?:final\s+)?answer\s+is\b)?[\s*_:]*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _unescaped(text: str, token: str, start: int) -> int:
    """Index of the next ``token`` at or after ``start`` not preceded by a backslash, or -1."""
    k = text.find(token, start)
    while k > 0 and text[k - 1] == "\\":
        k = text.find(token, k + 1)
    return k


def _answer_span(tail: str) -> str | None:
    r"""The answer at the start of ``tail`` (the text after a marker), or None.

    Leading bold/colons and an inner "the final answer is" are skipped; then a box, a math span
    (``$...$``, ``$$...$$``, ``\(...\)``, ``\[...\]``) or the rest of the line up to the end of
    the sentence (a period followed by a space; ``18.00`` keeps its point).
    """
    s = _LEAD.sub("", tail, count=1)
    if _BOXED.match(s):
        return _boxed_at(s, 0)
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left):
            end = _unescaped(s, right, len(left))
            if end > 0 and "\n\n" not in s[len(left) : end]:
                inner = s[len(left) : end].strip()
                return inner or None
            break  # an unclosed "$" is a currency sign: read the line
    line = s.split("\n", 1)[0]
    m = _SENTENCE_END.search(line)
    if m:
        line = line[: m.start()]
    line = line.strip().strip("*_").strip()
    return line or None


def _looks_like_answer(span: str) -> bool:
    """A span with a digit or a LaTeX command, or a short one ("A", "x", "yes"); prose after a
    marker ("This answer is correct") is not an answer."""
    return bool(re.search(r"[\d\\]", span)) or len(span) <= 3


def extract_answer(text: str, *, strict: bool = False) -> str | None:
    r"""The final answer written in ``text``, or None.

    Default: the last ``\boxed{...}``; else the answer after the last marker (``#### x``,
    ``Answer: x``, ``**Final Answer:** x``, ``The (final) answer is x``), skipping markers
    followed by prose. Strict (DAPO-style): whichever comes last of the last ``\boxed{x}`` and
    the last ``Answer: x`` line; other markers do not count.
    """
    boxed = _last_boxed(text)
    if strict:
        colon = list(_STRICT_MARKER.finditer(text))
        if colon and (boxed is None or colon[-1].start() > boxed[0]):
            return _answer_span(text[colon[-1].end() :])
        return None if boxed is None else boxed[1]
    if boxed is not None:
        return boxed[1]
    for m in reversed(list(_MARKER.finditer(text))):
        span = _answer_span(text[m.end() :])
        if span is not None and _looks_like_answer(span):
            return span
    return None


@lru_cache(maxsize=65536)
def reference_answer(answer: str) -> str:
    r"""The reference answer in ``answer`` (cached per string): a GSM8K solution's ``#### 72``, a
    MATH solution's last ``\boxed{}``, or the whole (stripped) string when it has no marker."""
    found = extract_answer(answer)
    return answer.strip() if found is None else found


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


_UNIT_COMMANDS = ("text", "textbf", "textrm", "mbox", "mathrm", "mathbf", "operatorname")
_NUMBER = re.compile(
    r"(?P<sign>[-+]?)\s*(?:"
    r"\\[dt]?frac\{(?P<fn>[-+]?\d+)\}\{(?P<fd>[-+]?\d+)\}"  # \frac{3}{4}
    r"|\\[dt]?frac(?P<sn>\d)(?P<sd>\d)"  # \frac34
    r"|(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"  # 1,000.5 | 18 | .5
    r"(?:\s*/\s*(?P<den>\d+))?"  # 3/4
    r")"
    # then only a unit: words of >= 2 letters, %, degrees, punctuation (no digits, no operators)
    r"(?P<unit>(?:\s|[A-Za-z]{2,}|\\?%|\^\s*\{?\\circ\}?|°|[.,;:!?'])*)"
)


@dataclass(frozen=True)
class _Number:
    value: Fraction
    # a value with <= 6 decimals and no percent sign: math_verify's float rounding leaves it as
    # is, and it has no second reading (math_verify takes "50%" as both 50 and 0.5)
    decisive: bool


@lru_cache(maxsize=65536)
def _plain_number(s: str) -> _Number | None:
    r"""``s`` as an exact number when it is a plain one (``18``, ``-1,000``, ``$18.00``,
    ``18 dollars``, ``18 \text{ dollars}``, ``\frac{3}{4}``, ``3/4``, ``50\%``, ``x = 5``); None
    for anything else (expressions, sets, several numbers)."""
    t = s.strip().replace("\u2212", "-")
    if t.startswith("\\boxed{") and t.endswith("}"):
        t = t[7:-1]
    for cmd in _UNIT_COMMANDS:  # \text{ dollars} -> " dollars"; \text{18} -> "18"
        t = _strip_command(t, cmd)
    t = t.replace("\\$", "").replace("$", "").replace("\\left", "").replace("\\right", "")
    for sp in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\(", "\\)", "\\[", "\\]"):
        t = t.replace(sp, " ")
    t = re.sub(r"^[A-Za-z]\s*=\s*", "", t.strip())  # x = 5 -> 5
    m = _NUMBER.fullmatch(t.strip())
    if m is None:
        return None
    try:
        if m.group("fn") is not None:
            num, den = Fraction(m.group("fn")), Fraction(m.group("fd"))
        elif m.group("sn") is not None:
            num, den = Fraction(m.group("sn")), Fraction(m.group("sd"))
        else:
            num = Fraction(m.group("num").replace(",", ""))
            den = Fraction(m.group("den")) if m.group("den") else Fraction(1)
    except (ValueError, ZeroDivisionError):
        return None
    if den == 0:
        return None
    value = num / den
    if m.group("sign") == "-":
        value = -value
    percent = "%" in m.group("unit")
    return _Number(value, (value * 10**6).denominator == 1 and not percent)


_TRAILING_WORDS = re.compile(r"(?<=[\d})])(?:\s+[A-Za-z]{2,})+\.?\s*$")


def _for_math_verify(span: str) -> str:
    r"""``span`` ready to be wrapped in ``$...$``: unescaped ``$`` and ``\(``/``\)`` removed,
    trailing plain-text units after a number or a brace dropped (``\frac{1}{2} cup``)."""
    t = span.replace("\\(", " ").replace("\\)", " ").strip()
    t = re.sub(r"(?<!\\)\$", "", t)
    t = _TRAILING_WORDS.sub("", t).strip().rstrip(".").strip()
    return t[:_MAX_SPAN]


_MAX_SPAN = 2000  # characters of an answer sent to math-verify (a final answer is short)


def answers_match(pred: str, ref: str, *, timeout_s: float = 5.0) -> bool:
    """True when the answer ``pred`` is equivalent to the reference ``ref``.

    Fast paths decide without math-verify: equal after :func:`normalize_answer`; both plain
    numbers (:func:`_plain_number`) that are equal, or unequal with at most 6 decimals each and
    no percent sign (which math-verify's rounding to 6 decimals cannot make equal, and which have
    no second reading such as 50% = 0.5); small expressions whose values decide
    (:func:`minippo.data._numeric.numeric_verdict`). Everything else is math-verify's
    ``verify(parse(ref), parse(pred))`` in the shared :class:`MathVerifier` (a deadline of
    ``timeout_s``; a timeout counts as not equivalent).
    """
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a and a == b:
        return True
    x, y = _plain_number(pred), _plain_number(ref)
    if x is not None and y is not None:
        if x.value == y.value:
            return True
        if x.decisive and y.decisive:
            return False
    gold, guess = _for_math_verify(ref), _for_math_verify(pred)
    if not gold or not guess:
        return False
    verdict = numeric_verdict(gold, guess)
    if verdict is not None:
        return verdict
    return shared_verifier().verify(gold, guess, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------------------
# math-verify in a child process


class MathVerifier:
    r"""``math_verify.verify(parse(gold), parse(pred))`` with a deadline per call, in any thread.

    math-verify's own timeout uses ``signal.alarm``, which only works in a process's main thread,
    and the recipe scores rewards in the rollout queue's thread. So the checks run in a child
    process (``_verify_worker.py``, started on first use): the child cuts a check at ``timeout_s``
    with an interval timer, and if it does not answer by ``timeout_s + grace_s`` (stuck in C code,
    e.g. a huge power) it is killed and restarted on the next call. Results (timeouts included)
    are cached per (gold, pred) pair; the child caches each parsed reference.

    Counters: ``calls`` (checks sent to the child), ``timeouts`` (checks cut at the deadline),
    ``restarts`` (children killed or found dead).

    Args:
        cache_size: (gold, pred) results kept (least recently used dropped first).
        grace_s: extra seconds the parent waits past ``timeout_s`` before killing the child.
        start_timeout_s: how long the child may take to start (imports sympy).
    """

    def __init__(
        self, *, cache_size: int = 65536, grace_s: float = 2.0, start_timeout_s: float = 120.0
    ) -> None:
        self.cache_size = cache_size
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self._cache: OrderedDict[tuple[str, str], bool] = OrderedDict()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()  # the parent process that owns the child
        self._buf = b""
        self.calls = 0
        self.timeouts = 0
        self.restarts = 0

    # -- child lifecycle --------------------------------------------------------------------

    def _start(self) -> subprocess.Popen:
        worker = Path(__file__).with_name("_verify_worker.py")
        proc = subprocess.Popen(
            [sys.executable, str(worker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # tracebacks of a crashing child go to our stderr
            bufsize=0,
        )
        self._buf = b""
        line = self._read_line(proc, self.start_timeout_s)
        if line != "ready":
            self._kill(proc)
            raise RuntimeError(
                f"the math-verify worker ({worker}) did not start (got {line!r}); is math-verify "
                f"installed? pip install math-verify (its error, if any, is printed above)"
            )
        return proc

    def _read_line(self, proc: subprocess.Popen, timeout_s: float) -> str | None:
        """One line from the child, or None on timeout or when it died."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:  # EOF: the child exited
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        with self._lock:
            if self._proc is not None and self._pid == os.getpid():
                self._kill(self._proc)
            self._proc = None

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and getattr(self, "_pid", None) == os.getpid():
            proc.kill()

    # -- checks -------------------------------------------------------------------------------

    def verify(self, gold: str, pred: str, *, timeout_s: float = 5.0) -> bool:
        """Whether ``pred`` is equivalent to ``gold`` (both LaTeX or plain math, no ``$``)."""
        key = (gold, pred)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            same = self._ask(gold, pred, timeout_s)
            self._cache[key] = same
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return same

    def _ask(self, gold: str, pred: str, timeout_s: float) -> bool:
        if self._pid != os.getpid():  # forked: the child belongs to the parent process
            self._proc, self._pid = None, os.getpid()
        if self._proc is not None and self._proc.poll() is not None:
            self.restarts += 1
            self._proc = None
        if self._proc is None:
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None
        self.calls += 1
        try:
            proc.stdin.write((json.dumps([gold, pred, timeout_s]) + "\n").encode())
        except BrokenPipeError:
            line = None
        else:
            line = self._read_line(proc, timeout_s + self.grace_s)
        if line in ("1", "0"):
            return line == "1"
        if line == "t":
            self.timeouts += 1
            log.warning(
                "math-verify ran past timeout_s=%.3g s on answer %.80r vs reference %.80r; "
                "scored as not equivalent",
                timeout_s,
                pred,
                gold,
            )
            return False
        # no answer by the hard deadline, or the child died: kill it, restart on the next call
        self.timeouts += 1
        self.restarts += 1
        self._kill(proc)
        self._proc = None
        log.warning(
            "the math-verify worker did not answer within %.3g s on answer %.80r vs reference "
            "%.80r (killed, restarted on the next call); scored as not equivalent",
            timeout_s + self.grace_s,
            pred,
            gold,
        )
        return False


_SHARED: MathVerifier | None = None
_SHARED_LOCK = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide :class:`MathVerifier` (one child process per Python process)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MathVerifier()
            atexit.register(_SHARED.close)
        return _SHARED
