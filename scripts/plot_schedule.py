"""Draw what the engine and the trainer do, step by step, from a run's metrics (docs/img).

    minippo run async_ppo --config tiny_cpu rollout.mode=alternate rollout.oversample=1.5 \
        output_dir=/tmp/alt progress_bar=false
    python scripts/plot_schedule.py /tmp/alt/metrics.jsonl docs/img/alternate_schedule.png

The bars are the measured durations of ``--steps`` consecutive steps (from ``--first``): per step
of ``rollout.mode: alternate`` the engine wakes and takes the new weights (``perf/publish_s``),
generates (``perf/rollout_s``) and sleeps (``perf/engine_sleep_s``); then the trainer scores
(``perf/prepare_s``) and trains (``perf/train_s``). Nothing overlaps: that is the point.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = (  # (metric, lane, label, colour), in the order they happen within a step
    ("perf/rollout_s", "engine", "generate", "#4c72b0"),
    ("perf/engine_sleep_s", "engine", "sleep", "#8c8c8c"),
    ("perf/offload_s", "trainer", "offload", "#dd8452"),
    ("perf/prepare_s", "trainer", "score (no grad)", "#55a868"),
    ("perf/train_s", "trainer", "PPO updates", "#c44e52"),
    ("perf/publish_s", "both", "wake + publish", "#8172b3"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="metrics.jsonl of a rollout.mode=alternate run")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--first", type=int, default=10, help="first step drawn")
    parser.add_argument("--steps", type=int, default=3, help="number of steps drawn")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if args.first <= r["step"] < args.first + args.steps]
    if not rows or "perf/rollout_s" not in rows[0]:
        raise SystemExit(f"{args.metrics}: no steps {args.first}.. of a rollout.mode=alternate run")
    fig, ax = plt.subplots(figsize=(10, 2.4))
    lanes = {"engine": 1, "trainer": 0}
    t, seen = 0.0, set()
    for r in rows:
        ax.axvline(t, color="black", lw=0.5, ls=":")
        ax.text(t, 1.55, f"step {r['step']}", fontsize=8, va="bottom")
        for key, lane, label, colour in PHASES:
            dur = float(r.get(key, 0.0))
            for y in lanes.values() if lane == "both" else [lanes[lane]]:
                ax.broken_barh(
                    [(t, dur)], (y - 0.35, 0.7), color=colour,
                    label=None if label in seen else label,
                )  # fmt: skip
                seen.add(label)
            t += dur
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(-0.6, 1.9)
    ax.set_xlabel("seconds (measured)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, fontsize=8, frameon=False)
    ax.set_title("rollout.mode: alternate, one GPU shared by engine and trainer", fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
