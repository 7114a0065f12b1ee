"""Environment calls run concurrently across episodes, each under a timeout.

:class:`EnvRunner` runs the ``reset`` / ``step`` calls of many episodes at once in a small pool
of daemon threads (``multi_turn.workers``). A call that raises, or runs past
``multi_turn.step_timeout_s``, is a fault of its episode: the run stops with one
:class:`EnvError` line naming the environment class and the prompt (``on_error: raise``), or the
episode ends with reward 0 and the fault is counted (``on_error: zero_reward``). A call that hangs
cannot be killed (Python threads cannot be): its thread is left behind as a daemon (it never
keeps the process alive), a fresh worker takes its place, and ``close`` names how many such
threads are still running.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

ON_ERROR = ("raise", "zero_reward")


class EnvError(RuntimeError):
    """An environment raised, hung past its timeout or answered something unusable (the message
    names the environment class and the prompt)."""


@dataclass(frozen=True)
class Fault:
    """Why an environment call gave no usable answer: ``kind`` "timeout" or "error"."""

    kind: str
    message: str


class EnvRunner:
    """Runs environment calls on ``workers`` daemon threads, each call bounded by ``timeout_s``.

    Args:
        name:      the environment's class name (in messages and thread names).
        workers:   threads that run calls at once (>= 1).
        timeout_s: seconds one call may run (from its start) before it is a fault.
    """

    def __init__(self, name: str, *, workers: int, timeout_s: float) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"multi_turn.workers must be an integer >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"multi_turn.step_timeout_s must be > 0, got {timeout_s!r}")
        self.name = name
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # workers that take tasks
        self._stuck: list[threading.Thread] = []  # threads left in a call past its timeout
        self._started: dict[int, tuple[float, threading.Thread]] = {}  # id(future) -> start
        self._lock = threading.Lock()
        self._closed = False

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` concurrently; return, in order, each call's result or a :class:`Fault`."""
        if self._closed:
            raise RuntimeError(f"the runner of environment {self.name} is closed")
        futures = [self._submit(fn) for fn in calls]
        return [self._wait(f) for f in futures]

    def _submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._lock:
            while len(self._threads) < self.workers:
                self._spawn()
        self._tasks.put((fut, fn))
        return fut

    def _spawn(self) -> None:
        n = len(self._threads) + len(self._stuck)
        t = threading.Thread(target=self._work, name=f"env-{self.name}-{n}", daemon=True)
        self._threads.append(t)
        t.start()

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._started[id(fut)] = (time.monotonic(), threading.current_thread())
            try:
                result = fn()
            except BaseException as e:  # reported as the episode's fault
                fut.set_exception(e)
            else:
                fut.set_result(result)
            with self._lock:
                if threading.current_thread() in self._stuck:
                    self._stuck.remove(threading.current_thread())
                    return  # a fresh worker took this one's place

    def _wait(self, fut: Future) -> Any:
        while True:
            with self._lock:
                started = self._started.get(id(fut))
            if started is None:  # still queued behind other calls
                try:
                    return self._outcome(fut, fut.exception(timeout=0.05))
                except TimeoutError:
                    continue
            left = started[0] + self.timeout_s - time.monotonic()
            try:
                error = fut.exception(timeout=max(left, 0.0))
            except TimeoutError:
                if fut.done():  # answered just now
                    return self._outcome(fut, fut.exception())
                return self._abandon(fut, started[1])
            return self._outcome(fut, error)

    def _outcome(self, fut: Future, error: BaseException | None) -> Any:
        with self._lock:
            self._started.pop(id(fut), None)
        if error is not None:
            return Fault("error", f"raised {type(error).__name__}: {error}")
        return fut.result()

    def _abandon(self, fut: Future, thread: threading.Thread) -> Fault:
        """The call runs past its timeout: its thread is retired (it leaves once the call
        returns, if ever) and a new worker takes its place."""
        with self._lock:
            self._started.pop(id(fut), None)
            if thread in self._threads:
                self._threads.remove(thread)
                self._stuck.append(thread)
                self._spawn()
        return Fault(
            "timeout", f"did not answer within multi_turn.step_timeout_s={self.timeout_s:g}"
        )

    def alive_threads(self) -> list[threading.Thread]:
        """Threads of this runner still running (workers and calls past their timeout)."""
        with self._lock:
            return [t for t in self._threads + self._stuck if t.is_alive()]

    def close(self, timeout_s: float = 2.0) -> int:
        """Stop the workers; return how many threads are still inside a call (hung)."""
        if self._closed:
            return len(self.alive_threads())
        self._closed = True
        with self._lock:
            workers = list(self._threads)
        for _ in workers:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout_s
        for t in workers:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
        return len(self.alive_threads())
