"""SIGTERM and SIGINT (Ctrl-C) stop a run at the next step boundary, with a checkpoint.

A signal does not interrupt the step that runs: it sets a flag, and at the end of the step every
rank agrees (one small all-reduce: a signal on any rank stops them all, at the same step), saves a
checkpoint and leaves with :class:`Interrupted`, which ``minippo run`` prints as one line::

    interrupted at step 12; resume with resume_from=latest

and an exit code of 128 + the signal number (130 for SIGINT, 143 for SIGTERM). The wait is
bounded: if no step boundary is reached within ``grace_s`` seconds of the signal (a long step, a
collective whose peer is gone), the process exits at once, keeping the last complete checkpoint
(an interrupted save leaves only a ``.tmp`` folder, which the next save removes). A second signal
exits at once too. Under torchrun the launcher forwards the signal to every rank and waits 30 s
before killing them, so the default ``grace_s`` is below that.

Ctrl-C reaches every process of the terminal's process group, the engine processes too: a process
started inside :func:`children_ignore_sigint` ignores it from its first instruction (a spawned
Python keeps an ignored SIGINT), so one still importing torch prints no KeyboardInterrupt of its
own; the trainer stops it. An error met after a handled signal is reported as the interrupt
(``minippo.config.report_error``: "interrupted", exit code 128 + the signal).

    interrupt = StopOnSignal().install()
    for step in ...:
        ...train...
        interrupt.at_step_end(step + 1, save=save_checkpoint)  # raises Interrupted after saving
    interrupt.uninstall()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

# torchrun waits 30 s after forwarding a signal before it kills the ranks
DEFAULT_GRACE_S = float(os.environ.get("MINIPPO_INTERRUPT_GRACE_S", "25"))
RESUME_HINT = "resume with resume_from=latest"


class Interrupted(Exception):
    """The run stopped at a step boundary on SIGTERM / SIGINT after saving a checkpoint.

    Attributes:
        step: training steps done (the checkpoint's step).
        signum: the signal received.
        exit_code: ``128 + signum``, the shell's convention for a process ended by a signal.
    """

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"interrupted at step {step}; {resume_hint()}")
        self.step = step
        self.signum = signum
        self.exit_code = 128 + signum


def resume_hint() -> str:
    """How to resume: ``resume_from=latest``, and the folder when the config names a new folder
    per launch (the same command would start a new one)."""
    from minippo.training.output_dir import claimed_per_launch

    folder = f" output_dir={claimed_per_launch}" if claimed_per_launch is not None else ""
    return RESUME_HINT + folder


# the first signal a StopOnSignal handled in this process (None: none): an error met after it
# (a process the signal stopped) is reported as the interrupt
received: int | None = None


class StopOnSignal:
    """Turns SIGTERM / SIGINT into a stop at the next step boundary (see the module docstring).

    Args:
        grace_s: seconds from the first signal to the step boundary; past them the process exits
            without saving (the last checkpoint stays).
        signals: the signals handled.
    """

    def __init__(
        self,
        grace_s: float = DEFAULT_GRACE_S,
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self.grace_s = grace_s
        self.signals = signals
        self.signum: int | None = None  # the first signal received
        self.step = 0  # steps done at the last boundary
        self._previous: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None

    def install(self) -> StopOnSignal:
        """Handle the signals from now on (a no-op outside the main thread, where Python cannot
        install handlers)."""
        global received
        received = None
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers; cancel the deadline. Idempotent."""
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        global received
        if self.signum is not None:  # a second signal: leave now
            _exit_now(f"interrupted again during step {self.step + 1}; exiting at once", signum)
        self.signum = received = signum
        self._deadline = threading.Timer(self.grace_s, self._too_late)
        self._deadline.daemon = True
        self._deadline.start()

    def _too_late(self) -> None:
        _exit_now(
            f"interrupted during step {self.step + 1}, which did not end within {self.grace_s:g} s; "
            f"the last complete checkpoint is kept: {resume_hint()}",
            self.signum or signal.SIGTERM,
        )

    def requested(self) -> bool:
        """Whether a signal arrived on any rank (collective under torch.distributed)."""
        flag = self.signum is not None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        import torch

        from minippo.parallel import distributed

        device = distributed.collective_device()
        t = torch.tensor([float(flag), float(self.signum or 0)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed, signum = t.tolist()
        if agreed and self.signum is None:
            self.signum = int(signum)  # another rank's signal stops this one too
        return bool(agreed)

    def at_step_end(self, step: int, save: Callable[[int], Any]) -> None:
        """Call after each training step (``step`` steps done), on every rank: when a signal
        arrived, ``save(step)`` and raise :class:`Interrupted`."""
        self.step = step
        if self.requested():
            save(step)
            if self._deadline is not None:
                self._deadline.cancel()
            raise Interrupted(step, self.signum or signal.SIGTERM)


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started in this block ignore SIGINT (Ctrl-C) from their start: wrap the
    ``Process.start()`` of a helper process that its parent stops (an engine). SIGINT is ignored
    here for the block's duration (the start of a process: milliseconds); outside the main thread,
    where Python cannot change handlers, the block does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_now(message: str, signum: int) -> None:
    """Print ``message`` (rank 0) and end the process without cleanup; the engine processes die
    with it, the output_dir lock goes with it."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    os._exit(128 + signum)
