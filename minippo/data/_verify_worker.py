"""The child process behind :class:`minippo.data.rewards.MathVerifier`: ``math_verify`` with a
deadline per request.

Run as a script (``python _verify_worker.py``), so that it imports only ``math_verify`` and the
standard library (not minippo, not torch). It answers one request at a time over its stdin/stdout:

* on start it writes ``ready``;
* a request is one JSON line ``[gold, pred, timeout_s]`` (two answer strings, the reference
  first; ``math_verify.verify`` is not symmetric);
* the answer is one line: ``1`` (equivalent), ``0`` (not equivalent, or not parseable) or ``t``
  (parsing + comparing ran past ``timeout_s`` seconds; a ``SIGALRM`` interval timer cuts it).

Both strings are parsed as LaTeX math (``$...$``, then math_verify's plain-expression parser), the
reference through a cache so that each prompt's reference is parsed once. The process exits when
its stdin closes (the parent is gone).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from functools import lru_cache


class _Deadline(BaseException):
    """Raised by the interval timer; a BaseException so that no ``except Exception`` in
    math_verify or sympy swallows it."""


def _on_alarm(signum, frame):
    raise _Deadline


def main() -> None:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # the timeout is ours (below): math_verify's signal-based one is off, and so is its warning
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    config = (LatexExtractionConfig(), ExprExtractionConfig())

    def parse_answer(text: str) -> list:
        return parse("$" + text + "$", extraction_config=config, parsing_timeout=None)

    parse_gold = lru_cache(maxsize=16384)(parse_answer)
    parse_pred = lru_cache(maxsize=16384)(parse_answer)

    signal.signal(signal.SIGALRM, _on_alarm)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, pred, timeout_s = json.loads(line)
        reply = "t"
        try:
            signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
            try:
                g = parse_gold(gold)
                p = parse_pred(pred)
                same = bool(g) and bool(p) and verify(g, p, timeout_seconds=None)
                reply = "1" if same else "0"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:  # also when the timer fires after the reply is known: keep that reply
            pass
        out.write(reply + "\n")
        out.flush()


if __name__ == "__main__":
    main()
