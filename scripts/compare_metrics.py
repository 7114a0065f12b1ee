"""Do two runs give the same metrics, bit for bit? Compare their ``metrics.jsonl``.

    python scripts/compare_metrics.py /tmp/before/metrics.jsonl /tmp/after/metrics.jsonl

Every row (one per logged step, in order) must have the same keys and every value must be equal
exactly (floats compared as the numbers JSON wrote, no tolerance), except the keys that measure
time and so differ between two runs of the same command (``TIMING``; ``--also-skip KEY`` adds
one). Prints ``same: N rows, K keys compared`` and exits 0, or names the first difference (row,
step, key, both values) and exits 1. Use it to check that a refactor changes no number: run the
same seeded command before and after (docs/recipe.md "Determinism" says which runs repeat).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Keys whose values depend on wall-clock time or on thread timing, never on what was trained:
TIMING_PREFIXES = ("perf/",)  # durations and throughputs of the step's phases
TIMING = (
    "rollout/tokens_per_s",  # tokens / generation seconds
    "rollout/gen_time_s",
    "rollout/wait_s",  # the trainer's wait in get_batch
    "rollout/tokens_per_s_total",
    "rollout/capacity_waits",  # overlap: whether the producer was ahead when it started a batch
    "rollout/capacity_wait_s",
    "rollout/publish_drain_wait_s",
    "rollout/buffered_batches",  # overlap: whether the next batch was ready already
    "rollout/tokens_total",  # overlap: counts the batch generated ahead if it was ready already
)


def skipped(key: str, also: tuple[str, ...] = ()) -> bool:
    """Whether ``key`` is a timing key (or one of ``also``), not compared."""
    return key.startswith(TIMING_PREFIXES) or key in TIMING or key in also


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_difference(a: list[dict], b: list[dict], also: tuple[str, ...] = ()) -> str | None:
    """The first difference between two runs' rows, in words; None when they are the same."""
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)} rows"
    for i, (ra, rb) in enumerate(zip(a, b)):
        keys_a = {k for k in ra if not skipped(k, also)}
        keys_b = {k for k in rb if not skipped(k, also)}
        if keys_a != keys_b:
            only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
            return f"row {i} (step {ra.get('step')}): keys only in A {only_a}, only in B {only_b}"
        for key in sorted(keys_a):
            if ra[key] != rb[key] or type(ra[key]) is not type(rb[key]):
                return (
                    f"row {i} (step {ra.get('step')}): {key} = {ra[key]!r} in A, {rb[key]!r} in B"
                )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="metrics.jsonl of the first run")
    parser.add_argument("b", type=Path, help="metrics.jsonl of the second run")
    parser.add_argument("--also-skip", action="append", default=[], metavar="KEY")
    args = parser.parse_args(argv)
    a, b = read_rows(args.a), read_rows(args.b)
    also = tuple(args.also_skip)
    diff = first_difference(a, b, also)
    if diff is not None:
        print(f"differ: {diff}")
        return 1
    keys = {k for row in a for k in row if not skipped(k, also)}
    print(f"same: {len(a)} rows, {len(keys)} keys compared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
