"""Learning checks over many seeds: a count of the seeds that reach a bar.

A learning claim is a distribution. One seed's outcome moves with the last bits of the arithmetic
(another CPU's kernels sum in another order, and over an RL run that moves a seed's outcome as
much as a change of seed does), so a slow learning test runs ``n`` seeds and asserts that at least
``k`` of them reach the bar. ``n`` and ``k`` come from measured rates (``benchmarks/
learning_sweep.py``, 60 seeds, written next to each test) and from the binomial law:

* a regression to the rate before the fix (``p_bad``, the share of seeds that missed the bar)
  must fail: ``pass_probability(n, k, p_bad) <= 0.10``. For a job whose rate before was not
  measured, or that has no fix yet, the rate to catch is a job that has stopped learning: 9 of
  10 seeds miss;
* luck must not fail a healthy run: ``pass_probability(n, k, p_good) >= 0.95``, with ``p_good``
  the measured miss rate after the fix, taken at its pessimistic estimate (``x + 1`` misses in
  ``N + 2`` runs, so 0 of 60 counts as 1/62: a rate never observed is not assumed to be zero).

``tests/unit/test_seed_counts.py`` checks both inequalities for every (n, k) used, from the rates
the tests declare, so a new measurement that no longer supports a choice fails there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# how many seeds' runs a slow test starts at once (each run: a trainer and an engine process)
PARALLEL_RUNS = 2


@dataclass(frozen=True)
class SeedCount:
    """``at_least`` of ``seeds`` must reach ``bar``; the miss rates it was chosen from:
    ``bad`` = (misses, runs) before the fix, ``good`` = (misses, runs) after it."""

    seeds: Sequence[int]
    at_least: int
    bar: float
    bad: tuple[int, int]
    good: tuple[int, int]

    @property
    def p_bad(self) -> float:
        return self.bad[0] / self.bad[1]

    @property
    def p_good(self) -> float:
        return (self.good[0] + 1) / (self.good[1] + 2)  # pessimistic: never exactly 0


def pass_probability(n: int, k: int, p_miss: float) -> float:
    """P(at least ``k`` of ``n`` independent seeds reach the bar) when each misses it with
    probability ``p_miss``."""
    return sum(math.comb(n, j) * p_miss**j * (1 - p_miss) ** (n - j) for j in range(n - k + 1))


def run_seeds(fn: Callable[[int], T], seeds: Sequence[int]) -> dict[int, T]:
    """``{seed: fn(seed)}``, ``PARALLEL_RUNS`` seeds at a time (the runs are seeded: running
    them side by side changes their wall time only)."""
    with ThreadPoolExecutor(max_workers=PARALLEL_RUNS) as pool:
        return dict(zip(seeds, pool.map(fn, seeds)))


def check_seed_count(scores: Mapping[int, float], spec: SeedCount, what: str) -> None:
    """Assert that at least ``spec.at_least`` of ``scores`` (seed -> final score) reach
    ``spec.bar``."""
    assert sorted(scores) == sorted(spec.seeds), (sorted(scores), spec.seeds)
    reached = sum(v >= spec.bar for v in scores.values())
    text = ", ".join(f"seed {k}: {v:.3f}" for k, v in sorted(scores.items()))
    assert reached >= spec.at_least, (
        f"{what}: {reached} of {len(scores)} seeds reach {spec.bar}, at least {spec.at_least} "
        f"must ({text})"
    )
