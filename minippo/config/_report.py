"""How a run ends on an error: one ``minippo: error:`` line, no traceback.

Bad input (a config value, a missing or corrupt file) is reported by the exception's message, which
names the key or the file and the fix; ``MINIPPO_LOG_LEVEL=DEBUG`` prints the traceback as well.
``minippo run`` and a recipe run as a script (``python recipes/async_ppo.py``, or each rank under
torchrun) end the same way, through :func:`run_recipe`.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from minippo.config._errors import ConfigError

# errors whose message says it all; any other type is named in the line (a bug, most likely)
_PLAIN = (ValueError, OSError, RuntimeError, ImportError, TimeoutError)


def debug() -> bool:
    """Whether ``MINIPPO_LOG_LEVEL=DEBUG`` asks for tracebacks."""
    return os.environ.get("MINIPPO_LOG_LEVEL", "").upper() == "DEBUG"


def error_lines(e: BaseException) -> list[str]:
    """The lines that report ``e``: one per problem of a ConfigError, else one."""
    if isinstance(e, ConfigError) and len(e.problems) > 1:
        return list(e.problems)
    parts = [_one_line(e)]
    if isinstance(e, ConfigError):  # its message says it all
        return parts
    cause, seen = e.__cause__, 0
    while cause is not None and seen < 3:  # "the producer failed" + why
        text = _one_line(cause)
        if text and text not in parts[-1]:
            parts.append(text)
        cause, seen = cause.__cause__, seen + 1
    return [": ".join(parts)]


def _one_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and not isinstance(e, ConfigError):  # a traceback in a message: its end
        text = f"{text} {lines[-1]}"
    elif len(lines) > 1:
        text = "; ".join(lines)
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    if not isinstance(e, _PLAIN) or not text:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def report_error(e: BaseException) -> int:
    """Print ``e`` to stderr (see the module docstring); return the process exit code:
    2 for a config error, 128 + signal for an interrupt, 1 otherwise."""
    from minippo.training import interrupt
    from minippo.training.interrupt import Interrupted

    rank = os.environ.get("RANK")
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    signum = interrupt.received  # a signal arrived: what failed after it failed because of it
    if isinstance(e, Interrupted | KeyboardInterrupt) or (signum is not None and not debug()):
        if rank in (None, "0"):
            print(str(e) if isinstance(e, Interrupted) else "interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 128 + (signum or 2))
    if debug():
        traceback.print_exception(e)
    tag = f"[rank {rank}] " if several else ""
    lines = error_lines(e)
    if not isinstance(e, _PLAIN) and not debug():
        lines[-1] += " (MINIPPO_LOG_LEVEL=DEBUG prints the traceback)"
    for line in lines:
        print(f"minippo: error: {tag}{line}", file=sys.stderr)
    sys.stderr.flush()
    return 2 if isinstance(e, ConfigError) else 1


def setup_logging() -> None:
    """Log at ``MINIPPO_LOG_LEVEL`` (default WARNING)."""
    level = os.environ.get("MINIPPO_LOG_LEVEL", "WARNING").upper()
    known = isinstance(logging.getLevelName(level), int)
    logging.basicConfig(level=level if known else "WARNING")


def run_recipe(recipe_main: Callable[[Any], Any], argv: list[str] | None = None) -> NoReturn:
    """A recipe script's entry point: parse ``--config`` and overrides, run ``recipe_main(cfg)``
    and exit, reporting an error in one line (exit code 2 for bad input, 1 otherwise)."""
    from minippo.config._parse import parse_recipe_args

    setup_logging()
    try:
        recipe_main(parse_recipe_args(argv))
    except (Exception, KeyboardInterrupt) as e:
        sys.exit(report_error(e))
    sys.exit(0)
