"""The seed counts of the slow learning tests are supported by their measured rates
(tests/recipes/seeds.py): a regression to the old stall rate fails them, luck does not."""

from __future__ import annotations

import pytest

from tests.recipes.seeds import SeedCount, pass_probability
from tests.recipes.test_alternate_mode import ALTERNATE_SEEDS
from tests.recipes.test_async_ppo import SYNC_EVERY_3_SEEDS, TINY_CPU_NO_LATE_DIP, TINY_CPU_SEEDS
from tests.recipes.test_multi_turn import RETRY_SEEDS, TOOL_SEEDS
from tests.recipes.test_tiny_math_cpu import MATH_SEEDS


def test_pass_probability_by_hand():
    assert pass_probability(3, 3, 0.1) == pytest.approx(0.9**3)
    assert pass_probability(3, 2, 0.1) == pytest.approx(0.9**3 + 3 * 0.1 * 0.9**2)
    assert pass_probability(5, 0, 0.7) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "spec",
    [
        TINY_CPU_SEEDS,
        TINY_CPU_NO_LATE_DIP,
        ALTERNATE_SEEDS,
        SYNC_EVERY_3_SEEDS,
        MATH_SEEDS,
        RETRY_SEEDS,
        TOOL_SEEDS,
    ],
    ids=[
        "tiny_cpu",
        "tiny_cpu_no_late_dip",
        "alternate",
        "sync_every_3",
        "math",
        "multiturn_retry",
        "multiturn_tool",
    ],
)
def test_seed_count_separates_the_old_rate_from_the_new(spec: SeedCount):
    n = len(spec.seeds)
    assert pass_probability(n, spec.at_least, spec.p_bad) <= 0.10, "a regression would pass"
    assert pass_probability(n, spec.at_least, spec.p_good) >= 0.95, "luck would fail it"
