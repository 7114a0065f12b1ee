"""Learning over many seeds: the distribution of outcomes of one config, not one seed's luck.

    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59
    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59 rollout.samples_per_prompt=8
    python benchmarks/learning_sweep.py --config tiny_math_cpu --seeds 0-9 --score eval/pass@1
    python benchmarks/learning_sweep.py --config tiny_cpu --seeds 0-59 --jobs 2   # figures only
    python benchmarks/learning_sweep.py --seeds 0-9 --baseline "lr_scheduler.warmup_steps=0"

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
contended, so time runs with ``--jobs 1`` on a quiet machine. ``--baseline '<overrides>'`` is
the A/B form: every seed also runs with those overrides instead of the positional ones, the two
sides interleaved one run at a time (so both meet the same load), then both tables and the
candidate/baseline ratios of the training seconds to ``--bar`` and of the command's wall time.
"""

from __future__ import annotations

import argparse
import json
import shlex
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


def report(rows: list[dict], a: argparse.Namespace, title: str) -> dict:
    """Print one side's summary line and per-seed table; return its summary."""
    s = summary(rows, a.target, a.bar)
    print(
        f"{title}{s['at_or_above_target']} of {s['seeds']} seeds >= {a.target}, {s['below_bar']} "
        f"below {a.bar}; final min {fmt(s['min'])}, mean {fmt(s['mean'])}; median first step >= "
        f"{a.bar}: {s['median_first_step']}, median training s to it: "
        f"{fmt(s['median_seconds_to_bar'])}; median command {s['median_wall_s']:.1f} s; late dips "
        f"(>= {a.high}, then < {a.bar}): {s['late_dips']}"
    )
    rows_md = [
        [r["seed"], fmt(r["final"]), fmt(r["first_step"]), fmt(r["seconds_to_bar"]),
         f"{r['wall_s']:.1f}", "yes" if r["late_dip"] else ""]
        for r in rows
    ]  # fmt: skip
    headers = ["seed", "final", f"first step >= {a.bar}", "train s to it", "command s", "dip"]
    print(markdown_table(headers, rows_md))
    return s


def ratios(base: list[dict], cand: list[dict], bar: float) -> None:
    """Candidate / baseline per seed (runs interleaved): training seconds to the bar (seeds where
    both reach it) and the whole command; their medians."""
    to_bar = [
        c["seconds_to_bar"] / b["seconds_to_bar"]
        for b, c in zip(base, cand)
        if b["seconds_to_bar"] and c["seconds_to_bar"]
    ]
    wall = [c["wall_s"] / b["wall_s"] for b, c in zip(base, cand)]
    med = statistics.median(to_bar) if to_bar else None
    print(
        f"candidate / baseline, median over seeds: training s to {bar} {fmt(med)} "
        f"({len(to_bar)} seeds where both reach it), command {statistics.median(wall):.3f}"
    )


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
    p.add_argument(
        "--baseline", default=None, metavar="'KEY=VALUE ...'",
        help="also run every seed with these overrides (instead of the positional ones), "
        "interleaved with the candidate, one run at a time; prints both and their time ratios",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds = [0]
        a.overrides += QUICK
    sides = {"": a.overrides}
    if a.baseline is not None:
        sides = {"baseline": shlex.split(a.baseline), "candidate": a.overrides}
        a.jobs = 1  # the two sides' seconds are compared: never contended by each other

    def one(job: tuple[str, int]) -> dict:
        side, seed = job
        out = a.out / side / f"seed{seed}"
        run = run_recipe([f"seed={seed}", *sides[side]], out, config=a.config)
        if run.returncode != 0:
            raise RuntimeError(
                f"seed {seed}: the run failed (exit {run.returncode}):\n{run.log_tail}"
            )
        row = {"seed": seed, "wall_s": run.wall_s, **outcome(run, a.score, a.bar, a.high)}
        print(f"{side + ' ' if side else ''}seed {seed:3d}: final {fmt(row['final'])}, first "
              f"step >= {a.bar} {fmt(row['first_step'])}, {run.wall_s:.1f} s", flush=True)  # fmt: skip
        return {"side": side, **row}

    # interleaved: seed k runs baseline then candidate, seed k + 1 the other way round
    names = list(sides)
    jobs = [(side, seed) for i, seed in enumerate(a.seeds) for side in names[:: 1 - 2 * (i % 2)]]
    try:
        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            done = list(pool.map(one, jobs))
    except RuntimeError as e:
        print(e)
        return 1
    rows = {side: [r for r in done if r["side"] == side] for side in names}
    command = "python benchmarks/learning_sweep.py " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    print(f"\n{command}\n{machine()}" + (f", {a.jobs} runs at once" if a.jobs > 1 else ""))
    summaries = {side: report(rows[side], a, f"{side}: " if side else "") for side in names}
    if a.baseline is not None:
        ratios(rows["baseline"], rows["candidate"], a.bar)
    if a.json:
        out = {"command": command, "summary": summaries, "runs": done}
        if a.baseline is None:
            out = {"command": command, "summary": summaries[""], "runs": rows[""]}
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
