"""Learning over many seeds: the distribution of outcomes of one config, not one seed's luck.

    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59
    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59 rollout.samples_per_prompt=8
    python benchmarks/learning_sweep.py --config tiny_math_cpu --seeds 0-9 --score eval/pass@1
    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59 --jobs 2   # figures only

Runs ``minippo run async_ppo --config <config> seed=<k> <overrides>`` for each seed, one at a time,
and reads each run's metrics.jsonl. Per seed: the final score (the mean of the last 5 logged values
of ``--score``; ``eval/...`` scores: the last logged value), the first step at which the score
reaches ``--bar``, the training seconds to get there (the sum of ``perf/step_s`` up to it), the
whole command's wall time, and whether a run that reached ``--high`` later fell below ``--bar``
(a late dip). Then the summary a learning claim needs: how many seeds end at or above ``--target``,
how many below ``--bar``, the lowest and the mean final score, the median first step and the median
seconds to ``--bar``. The per-seed table is printed in the Markdown docs/benchmarks.md uses; ``--json`` keeps every
run's figures; ``--quick`` runs one seed of 4 small steps (the test that keeps the script working).

Wall times depend on the machine and its load (the summary line names both); the learning figures
of a seed are the same on one machine whatever the load (the runs are seeded), and differ between
CPUs in the last bits of the arithmetic, which compound over an RL run: compare distributions.
``--jobs N`` runs N seeds at once: the same learning figures, sooner; its seconds are then
contended, so time runs with ``--jobs 1`` on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import DEFAULT_OUT, RecipeRun, machine, markdown_table, run_recipe

QUICK = ["total_steps=4", "rollout.groups_per_batch=8", "ppo.minibatches=2",
         "ppo.micro_batch_size=8"]  # fmt: skip


def parse_seeds(text: str) -> list[int]:
    """'0-59' or '0,3,7' or '1-3,9' -> the seeds, in order."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def outcome(run: RecipeRun, score: str, bar: float, high: float) -> dict:
    """One run's figures (module docstring); ``final`` None when the run logged no score."""
    values = [(int(m["step"]), float(m[score])) for m in run.metrics if score in m]
    steps = {int(m["step"]): float(m.get("perf/step_s", 0.0)) for m in run.metrics}
    if not values:
        return {"final": None, "first_step": None, "seconds_to_bar": None, "late_dip": None}
    last = [v for _, v in values[-5:]] if not score.startswith("eval/") else [values[-1][1]]
    first = next((s for s, v in values if v >= bar), None)
    reached_high = next((i for i, (_, v) in enumerate(values) if v >= high), None)
    dip = reached_high is not None and any(v < bar for _, v in values[reached_high:])
    return {
        "final": statistics.fmean(last),
        "first_step": first,
        "seconds_to_bar": None if first is None else sum(t for s, t in steps.items() if s <= first),
        "late_dip": dip,
    }


def fmt(x: object) -> str:
    """A figure for the tables: 3 decimals for floats, '-' for None."""
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def summary(rows: list[dict], target: float, bar: float) -> dict:
    finals = [r["final"] for r in rows if r["final"] is not None]
    firsts = [r["first_step"] for r in rows if r["first_step"] is not None]
    seconds = [r["seconds_to_bar"] for r in rows if r["seconds_to_bar"] is not None]
    return {
        "seeds": len(rows),
        "at_or_above_target": sum(f >= target for f in finals),
        "below_bar": sum(f < bar for f in finals) + sum(r["final"] is None for r in rows),
        "min": min(finals, default=None),
        "mean": statistics.fmean(finals) if finals else None,
        "median_first_step": statistics.median(firsts) if firsts else None,
        "median_seconds_to_bar": statistics.median(seconds) if seconds else None,
        "median_wall_s": statistics.median(r["wall_s"] for r in rows),
        "late_dips": sum(bool(r["late_dip"]) for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny_cpu")
    p.add_argument("--seeds", default="0-59", type=parse_seeds)
    p.add_argument("--score", default="rollout/reward_mean", help="the metric judged")
    p.add_argument("--bar", type=float, default=0.8, help="a run below it did not learn")
    p.add_argument("--target", type=float, default=0.9, help="the final score every seed needs")
    p.add_argument("--high", type=float, default=0.95, help="a late dip starts from here")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "learning_sweep")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.add_argument("--quick", action="store_true", help="one seed, 4 small steps")
    p.add_argument(
        "--jobs", type=int, default=1,
        help="runs at once: the learning figures are the same (seeded), the seconds are not",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds = [0]
        a.overrides += QUICK

    def one(seed: int) -> dict:
        run = run_recipe([f"seed={seed}", *a.overrides], a.out / f"seed{seed}", config=a.config)
        if run.returncode != 0:
            raise RuntimeError(
                f"seed {seed}: the run failed (exit {run.returncode}):\n{run.log_tail}"
            )
        row = {"seed": seed, "wall_s": run.wall_s, **outcome(run, a.score, a.bar, a.high)}
        print(f"seed {seed:3d}: final {fmt(row['final'])}, first step >= {a.bar} "
              f"{fmt(row['first_step'])}, {run.wall_s:.1f} s", flush=True)  # fmt: skip
        return row

    try:
        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            rows = list(pool.map(one, a.seeds))
    except RuntimeError as e:
        print(e)
        return 1
    s = summary(rows, a.target, a.bar)
    command = "python benchmarks/learning_sweep.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(f"\n{command}\n{machine()}" + (f", {a.jobs} runs at once" if a.jobs > 1 else ""))
    print(
        f"{s['at_or_above_target']} of {s['seeds']} seeds >= {a.target}, {s['below_bar']} below "
        f"{a.bar}; final min {fmt(s['min'])}, mean {fmt(s['mean'])}; median first step >= {a.bar}: "
        f"{s['median_first_step']}, median training s to it: {s['median_seconds_to_bar']}; median "
        f"command {s['median_wall_s']:.1f} s; late dips (>= {a.high}, then < {a.bar}): "
        f"{s['late_dips']}"
    )
    rows_md = [
        [r["seed"], fmt(r["final"]), fmt(r["first_step"]), fmt(r["seconds_to_bar"]),
         f"{r['wall_s']:.1f}", "yes" if r["late_dip"] else ""]
        for r in rows
    ]  # fmt: skip
    headers = ["seed", "final", f"first step >= {a.bar}", "train s to it", "command s", "dip"]
    print(markdown_table(headers, rows_md))
    if a.json:
        a.json.write_text(json.dumps({"command": command, "summary": s, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
