"""A learning check over several seeds, with thresholds derived from measured runs.

One seed's final score moves with the last bits of the arithmetic: another CPU's kernels sum in
another order and, over hundreds of RL steps, a seed's outcome moves as much as a change of seed
does (docs/tiny_math_cpu.md: seed 0 of the math job gives pass@1 0.98 on one machine and 0.67 on
another). A slow learning test therefore runs ``SEEDS`` and checks two numbers, both derived from
``measured`` (the same score of earlier runs, several seeds and machines, written in the test):

* the mean over ``SEEDS`` must reach ``m - 2 s / sqrt(n)``: ``m`` and ``s`` the mean and sample
  standard deviation of ``measured``, ``n = len(SEEDS)``. The mean of n runs has standard error
  s / sqrt(n); 2 of them below the measured mean is reached by chance about 2 times in 100
  (normal tails) while a run that does not learn sits far lower.
* each seed must reach ``m - 3 s``: one run 3 standard deviations low (about 1 in 700) says
  something is broken, not unlucky.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

SEEDS = (0, 1, 2)


def thresholds(
    measured: Sequence[float], n: int = len(SEEDS), spread: float | None = None
) -> tuple[float, float]:
    """(the bound for the mean of ``n`` seeds, the bound for each seed); see the module doc.
    ``spread``: the standard deviation to use (None: that of ``measured``)."""
    m = statistics.fmean(measured)
    s = statistics.stdev(measured) if spread is None else spread
    return m - 2 * s / math.sqrt(n), m - 3 * s


def pooled_stdev(*groups: Sequence[float]) -> float:
    """The standard deviation of seed outcomes pooled over variants of one job (the mean of the
    groups' variances, groups of equal size): a variant whose few seeds happen to agree (all at
    the reward's ceiling) does not get a spread of ~0 from them."""
    return math.sqrt(statistics.fmean(statistics.variance(g) for g in groups))


def check_learns(
    scores: Mapping[int, float],
    measured: Sequence[float],
    what: str,
    spread: float | None = None,
) -> None:
    """Assert that ``scores`` (seed -> final score) pass both bounds of :func:`thresholds`."""
    mean_bound, each_bound = thresholds(measured, len(scores), spread)
    mean = statistics.fmean(scores.values())
    text = ", ".join(f"seed {k}: {v:.3f}" for k, v in scores.items())
    assert mean >= mean_bound, f"{what}: mean {mean:.3f} < {mean_bound:.3f} ({text})"
    assert min(scores.values()) >= each_bound, f"{what}: a seed < {each_bound:.3f} ({text})"
