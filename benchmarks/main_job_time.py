"""Keeps the README's figure for the main job honest: runs its command as a user types it and
compares the wall time with the range the README's Results table states for the machine it names.

    python benchmarks/main_job_time.py              # 3 runs of the README's command
    python benchmarks/main_job_time.py --runs 5

The command is read from README.md (the quick start's ``minippo run async_ppo --config tiny_cpu``)
and run unchanged, one run at a time, each in its own run folder (the config's per-launch
``output_dir``). Per run: the whole command's wall time (imports, engine start, 60 steps,
checkpoint, HF export) and the mean reward at step 0, at the first step >= 0.8 and at the last
step. The README's Results row for the main job says ``X–Y s for the whole command`` and names
the CPU it was measured on: when this machine's CPU model is that one, the median must lie in
[X, Y] (exit 1 otherwise, with the figures to write there); on another CPU the range does not
apply, and the script says so and exits 0 after printing the figures (wall times differ between
CPUs; docs/tiny_cpu.md gives each machine's). Run it on a quiet machine: the load average is
printed beside the result. ``--quick``: one run of 2 steps, the parsing and the table only.
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import DEFAULT_OUT, REPO, load_average, machine, markdown_table

from minippo.training.metrics import read_jsonl

QUICK = ["total_steps=2", "rollout.groups_per_batch=8", "ppo.minibatches=2",
         "checkpoint.export_hf=false"]  # fmt: skip


def readme_command(readme: str) -> list[str]:
    """The quick start's main-job command: the first ``minippo run async_ppo --config tiny_cpu``
    line of the README (its comment removed)."""
    for line in readme.splitlines():
        text = line.split("#", 1)[0].strip()
        if text.startswith("minippo run async_ppo --config tiny_cpu"):
            return shlex.split(text)
    raise ValueError("README.md has no `minippo run async_ppo --config tiny_cpu` line")


def readme_range(readme: str) -> tuple[float, float, str]:
    """(low, high, machine) of the Results row of the main job: ``X–Y s for the whole command``
    and the machine column."""
    for line in readme.splitlines():
        if line.startswith("| the main job"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            m = re.search(r"([\d.]+)[–-]([\d.]+) s for the whole command", cells[1])
            if m:
                return float(m.group(1)), float(m.group(2)), cells[2]
    raise ValueError(
        "README.md's Results table has no main-job row with 'X–Y s for the whole command'"
    )


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def one_run(command: list[str], extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "minippo", *command[1:], "progress_bar=false", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    metrics = Path(re.search(r"metrics: (\S+)", proc.stdout).group(1))
    rewards = [r["rollout/reward_mean"] for r in read_jsonl(metrics) if "rollout/reward_mean" in r]
    first = next((i for i, r in enumerate(rewards) if r >= 0.8), None)
    return {"wall_s": wall, "rewards": rewards, "first": first, "folder": metrics.parent}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of 2 steps: parsing and table")
    a = p.parse_args(argv)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = readme_command(readme)
    low, high, named = readme_range(readme)
    quick = [*QUICK, f"output_dir={DEFAULT_OUT}/main_job_time/{time.time_ns()}"]  # scratch
    runs = [one_run(command, quick if a.quick else []) for _ in range(1 if a.quick else a.runs)]
    rows = [
        [i, f"{r['wall_s']:.1f}", f"{r['rewards'][0]:.3f}",
         "-" if r["first"] is None else f"{r['first']} ({r['rewards'][r['first']]:.3f})",
         f"{r['rewards'][-1]:.3f}"]
        for i, r in enumerate(runs)
    ]  # fmt: skip
    print(markdown_table(["run", "command s", "reward step 0", "first >= 0.8", "last"], rows))
    median = statistics.median(r["wall_s"] for r in runs)
    print(
        f"{' '.join(command)}\n{machine()}\nmedian {median:.1f} s; README: {low}–{high} s on {named}"
    )
    if a.quick:
        return 0
    here = cpu_model()
    if not any(word in here for word in named.split() if len(word) > 3):
        print(f"the README's range was measured on {named}; this CPU is {here}: not compared")
        return 0
    if not low <= median <= high:
        print(f"OUTSIDE the README's range (load average {load_average():.2f}): re-measure on a "
              "quiet machine and update README.md, configs/tiny_cpu.yaml and docs/tiny_cpu.md")  # fmt: skip
        return 1
    print("within the README's range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
