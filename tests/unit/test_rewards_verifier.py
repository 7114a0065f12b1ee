"""MathVerifier: math-verify in a child process, with a deadline per call in any thread."""

import os
import pickle
import signal
import threading
import time

import pytest

from minippo.data import MathAnswerMatch, PromptExample
from minippo.data.rewards import MathVerifier


@pytest.fixture
def verifier():
    v = MathVerifier(grace_s=1.0)
    yield v
    v.close()


def test_checks_are_cached_per_pair(verifier):
    assert verifier.verify(r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2")
    assert not verifier.verify(r"\frac{\sqrt{3}}{2}", r"\sqrt{2}/2")
    assert verifier.calls == 2
    assert verifier.verify(r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2")
    assert verifier.calls == 2  # answered from the cache


def test_runs_in_a_thread_other_than_the_main_one():
    """The recipe scores rewards in the rollout queue's thread, where math-verify's own
    signal-based timeout cannot run."""
    reward = MathAnswerMatch()
    example = PromptExample(0, (1,), "q", r"(-\infty, 3]")
    out = {}

    def score():
        out["right"] = reward(example, r"\boxed{(-\infty,3]}")
        out["wrong"] = reward(example, r"\boxed{(-\infty,3)}")

    t = threading.Thread(target=score)
    t.start()
    t.join(timeout=120)
    assert out == {"right": 1.0, "wrong": 0.0}


def test_a_check_past_its_deadline_scores_false_and_the_next_one_works(verifier):
    t0 = time.monotonic()
    assert verifier.verify("5", r"10^{10^{10}}", timeout_s=1.0) is False
    assert time.monotonic() - t0 < 1.0 + verifier.grace_s + 1.0
    assert verifier.timeouts == 1
    assert verifier.verify("5", "10/2", timeout_s=1.0) is True


def test_a_stuck_child_is_killed_and_restarted(verifier):
    assert verifier.verify("2", "4/2")
    pid = verifier._proc.pid
    os.kill(pid, signal.SIGSTOP)  # stuck: it will not answer, not even at its own deadline
    t0 = time.monotonic()
    assert verifier.verify("3", "6/2", timeout_s=0.5) is False
    assert time.monotonic() - t0 < 0.5 + verifier.grace_s + 1.0
    assert (verifier.timeouts, verifier.restarts) == (1, 1)
    assert verifier.verify("3", "9/3")  # a fresh child
    assert verifier._proc.pid != pid


def test_a_dead_child_is_restarted(verifier):
    assert verifier.verify("2", "4/2")
    verifier._proc.kill()
    verifier._proc.wait()
    assert verifier.verify("7", "14/2")
    assert verifier.restarts == 1


def test_the_reward_pickles():
    reward = MathAnswerMatch(format_score=0.1, strict=True)
    copy = pickle.loads(pickle.dumps(reward))
    assert (copy.format_score, copy.strict) == (0.1, True)
    assert copy(PromptExample(0, (1,), "q", "4"), "Answer: 4") == 1.0
