"""Where one training step of the tiny CPU job spends its time: matmul/attention compute versus
everything else, by phase of the step.

    python benchmarks/step_overhead.py                          # the working tree, 3 runs
    python benchmarks/step_overhead.py --ref main --ref HEAD    # two commits, runs interleaved
    python benchmarks/step_overhead.py --ref . --ref ". compile=true" --warm 5   # config A/B
    python benchmarks/step_overhead.py --quick                  # one short run (CI smoke)

Each run is ``recipes/async_ppo.py`` with ``configs/tiny_cpu.yaml`` (fixed seed, no checkpoint
until the last step, no progress bar), built in a child process from the code of the ref it
measures: ``--ref REF`` exports that commit (``git archive``) into a temporary folder and runs
the recipe and the ``minippo`` package found there; without ``--ref``, or with ``--ref .``, it
runs this checkout's working tree. Words after the ref are config overrides for its runs
(``--ref "HEAD compile=true"``). Runs of several refs are interleaved (A B, B A, A B, ...) and every figure
is the median over runs of the median over steps, so that a machine shared with other jobs
moves them all alike.

One run trains ``warm + plain + 1 + profiled + 1`` steps:

* ``plain`` steps without a profiler: their ``perf/step_s`` (the recipe's own step clock,
  metrics.jsonl) is the step time; ``time.perf_counter`` around the recipe's methods gives each
  phase's wall time and ``time.thread_time`` the main thread's CPU time per step (less moved by
  other jobs than wall time: waiting for a core does not count);
* ``profiled`` steps under ``torch.profiler`` (CPU, main thread): the self time of the
  matmul/attention ops and their backward (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``,
  ``linear``, ``matmul`` and the ``scaled_dot_product`` family) is the compute of each phase;
  the other aten ops' self time (elementwise, reductions, copies, optimizer math) and the rest
  (Python, dispatch, waiting on the engine process) are shown beside it.

Phases are ``record_function`` ranges this script wraps around the recipe's methods (``PHASES``;
the recipe is not edited); what runs between them is "other". "non-matmul ms" is a phase's plain
wall time minus its profiled compute. The profiler adds a few microseconds to every op, so a
profiled step is slower than a plain one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import REPO, load_average, machine, markdown_table, read_metrics

COMPUTE_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::linear",
    "aten::matmul",
}
STEP_RANGE = "step"
# the phases of a step, in order, and what the recipe calls in each (``_wrap_phases``)
PHASES = {
    "wait for batch": "queue.get_batch: the rollout thread's batch (collated, rewards scored)",
    "no-grad passes": "correction.prepare, critic values (_scored), _retain_referenced",
    "advantages": "rl.gae, rl.explained_variance, rl.masked_whiten, rl.group_advantages",
    "forward+backward": "_actor_backward, _critic_backward (losses and their backward)",
    "loss statistics": "_add_shares, MetricAverager.result",
    "clip+optimizer": "clip_and_step (clip_grad_norm_, finite check, optimizer.step, zero_grad)",
    "correction update": "correction.after_optimizer_step (EWMA)",
    "publish": "_publish (weights into the engine process)",
    "metrics+logging": "gather_and_reduce, logger.log, progress.update",
}
OTHER = "other (between phases)"


def is_compute(name: str) -> bool:
    return name in COMPUTE_OPS or "scaled_dot_product" in name or "flash_attention" in name


# ----------------------------------------------------------------------------------------------
# Child: one run of the recipe, measured


class PhaseClock:
    """Wall seconds per outermost phase, summed over the steps it is on (``on``)."""

    def __init__(self) -> None:
        self.on = False
        self.depth = 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.wrapped: set[str] = set()  # the phases with a method wrapped

    def wrap(self, obj, attr: str, label: str) -> None:
        """Replace ``obj.attr`` by a call of it inside ``record_function(label)``, timed."""
        from torch.profiler import record_function

        fn = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                with record_function(label):
                    return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.on and self.depth == 0:
                    self.seconds[label] += time.perf_counter() - t0

        setattr(obj, attr, wrapped)
        self.wrapped.add(label)


def _wrap_phases(clock: PhaseClock, recipe, recipe_mod) -> None:
    from minippo.training.metrics import MetricAverager

    targets = [
        ("wait for batch", recipe.queue, "get_batch"),
        ("no-grad passes", recipe.correction, "prepare"),
        ("no-grad passes", recipe, "_scored"),
        ("no-grad passes", recipe, "_retain_referenced"),
        *[
            ("advantages", recipe_mod.rl, f)
            for f in ("gae", "explained_variance", "masked_whiten", "group_advantages")
        ],
        ("forward+backward", recipe, "_actor_backward"),
        ("forward+backward", recipe, "_critic_backward"),
        ("loss statistics", recipe, "_add_shares"),
        ("loss statistics", MetricAverager, "result"),
        ("clip+optimizer", recipe_mod, "clip_and_step"),
        ("clip+optimizer", recipe, "_clip_and_step"),  # the recipe's method before clip_and_step
        ("correction update", recipe.correction, "after_optimizer_step"),
        ("publish", recipe, "_publish"),
        ("metrics+logging", recipe_mod, "gather_and_reduce"),
        ("metrics+logging", recipe.logger, "log"),
        ("metrics+logging", recipe.progress, "update"),
    ]
    # a ref has one of the spellings listed for a phase: wrap what it has, and every phase
    for label, owner, attr in targets:
        if hasattr(owner, attr):
            clock.wrap(owner, attr, label)
    missing = set(PHASES) - set(clock.wrapped)
    if missing:
        raise RuntimeError(f"the recipe has none of the methods of the phases {sorted(missing)}")


def child(args: argparse.Namespace) -> dict:
    """Run the recipe with the ``minippo`` on ``sys.path`` (the ref's); return its figures."""
    import importlib.util

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from minippo.config import load_config

    repo = Path(args.repo)
    spec = importlib.util.spec_from_file_location("async_ppo", repo / "recipes" / "async_ppo.py")
    recipe_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_mod)

    warm, plain, prof_steps = args.warm, args.plain, args.profiled
    total = warm + plain + 1 + prof_steps + 1  # +1 profiler warm-up step, +1 last (checkpoint)
    cfg = load_config(
        repo / "configs" / "tiny_cpu.yaml",
        [
            f"output_dir={args.out}",
            "overwrite_output_dir=true",
            f"total_steps={total}",
            "progress_bar=false",
            "checkpoint.every_n_steps=100000",
            "checkpoint.export_hf=false",
            *args.override,
        ],
    )
    recipe = recipe_mod.AsyncPPORecipe(cfg)
    try:
        recipe.setup(cfg)
        clock = PhaseClock()
        _wrap_phases(clock, recipe, recipe_mod)
        # a step is from one get_batch call to the next, as the recipe's perf/step_s clock
        get_batch = recipe.queue.get_batch
        state = {"range": None, "prof": None}
        cpu_at: dict[int, float] = {}  # the main thread's CPU seconds when step s starts

        def stepped_get_batch(step):
            cpu_at[step] = time.thread_time()
            if state["range"] is not None:
                state["range"].__exit__(None, None, None)
            clock.on = warm <= step < warm + plain  # the plain steps' phases are timed
            state["prof"].step()
            state["range"] = record_function(STEP_RANGE)
            state["range"].__enter__()
            return get_batch(step)

        recipe.queue.get_batch = stepped_get_batch
        # profiler step 0 ends at the first get_batch: warm + plain steps later the warm-up starts
        schedule = torch.profiler.schedule(wait=warm + plain + 1, warmup=1, active=prof_steps)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule) as prof:
            state["prof"] = prof
            recipe.train()
            state["range"].__exit__(None, None, None)
    finally:
        recipe.cleanup()
    rows = read_metrics(Path(cfg.metric_logger.path))
    step_s = [r["perf/step_s"] for r in rows if warm <= r["step"] < warm + plain]
    if args.top:  # the ops with the most self time over the profiled steps (exploration)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    step_ms = 1e3 * statistics.median(step_s)
    cpu_s = [cpu_at[s + 1] - cpu_at[s] for s in range(warm, warm + plain)]
    plain_ms = {ph: 1e3 * t / plain for ph, t in clock.seconds.items()}
    plain_ms[OTHER] = 1e3 * sum(step_s) / plain - sum(plain_ms.values())
    return {
        "step_ms": step_ms,
        "cpu_ms": 1e3 * statistics.median(cpu_s),
        "plain_ms": plain_ms,
        **_breakdown(prof.events(), prof_steps),
    }


def _breakdown(events, n_steps: int) -> dict:
    """Per-step milliseconds of every phase: wall, compute, other aten self time, rest."""
    steps = [e for e in events if e.name == STEP_RANGE]
    steps = sorted(steps, key=lambda e: e.time_range.start)[-n_steps:]
    labels = set(PHASES)
    wall = defaultdict(float)
    compute = defaultdict(float)
    aten = defaultdict(float)

    def phase_of(e) -> str | None:
        found = None
        p = e.cpu_parent
        while p is not None:
            if p.name in labels:
                found = p.name  # keep climbing: the outermost phase wins
            if p.name == STEP_RANGE:
                return found or OTHER
            p = p.cpu_parent
        return None

    for e in events:
        if e.name in labels:
            ph = phase_of(e)
            if ph == OTHER:  # an outermost range
                wall[e.name] += e.cpu_time_total
            continue
        if not e.name.startswith("aten::"):
            continue
        ph = phase_of(e)
        if ph is None:
            continue
        if is_compute(e.name):
            compute[ph] += e.self_cpu_time_total
        else:
            aten[ph] += e.self_cpu_time_total
    step_total = sum(e.cpu_time_total for e in steps)
    wall[OTHER] = step_total - sum(wall.values())
    n = max(len(steps), 1)
    return {
        "steps": len(steps),
        "profiled_step_ms": step_total / n / 1e3,
        "phases": {
            ph: {
                "wall": wall[ph] / n / 1e3,
                "compute": compute[ph] / n / 1e3,
                "aten": aten[ph] / n / 1e3,
            }
            for ph in [*PHASES, OTHER]
        },
    }


# ----------------------------------------------------------------------------------------------
# Parent: runs per ref, interleaved; tables


def export_ref(ref: str, into: Path) -> Path:
    """The tree of commit ``ref`` in a new folder (``git archive``)."""
    dest = into / ref.replace("/", "_")
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref], cwd=REPO, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def run_child(repo: Path, out: Path, args: argparse.Namespace, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--repo", str(repo)]
    cmd += ["--out", str(out), "--warm", str(args.warm), "--plain", str(args.plain)]
    cmd += ["--profiled", str(args.profiled), *(f"--override={o}" for o in overrides)]
    env = dict(os.environ, PYTHONPATH=str(repo))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT=")]
    if proc.returncode or not lines:
        raise SystemExit(f"run in {repo} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT=") :])


def median_result(results: list[dict]) -> dict:
    med = statistics.median
    return {
        "step_ms": med(r["step_ms"] for r in results),
        "cpu_ms": med(r["cpu_ms"] for r in results),
        "profiled_step_ms": med(r["profiled_step_ms"] for r in results),
        "plain_ms": {
            ph: med(r["plain_ms"].get(ph, 0.0) for r in results) for ph in results[0]["phases"]
        },
        "phases": {
            ph: {k: med(r["phases"][ph][k] for r in results) for k in ("wall", "compute", "aten")}
            for ph in results[0]["phases"]
        },
    }


def phase_table(res: dict) -> str:
    rows = []
    for ph, v in res["phases"].items():
        plain = res["plain_ms"][ph]
        rest = v["wall"] - v["compute"] - v["aten"]
        rows.append([ph, plain, v["compute"], plain - v["compute"], v["wall"], v["aten"], rest])
    rows.append(["**step**", *[sum(r[i] for r in rows) for i in range(1, 7)]])
    headers = ["phase", "wall ms", "matmul/attention ms", "non-matmul ms"]
    headers += ["profiled: wall ms", "other aten ms", "Python, waits ms"]
    return markdown_table(headers, rows)


def comparison_table(labels: list[str], results: dict[str, dict]) -> str:
    """Per phase: each ref's plain wall time and non-matmul time side by side."""
    rows = []
    phases = list(results[labels[0]]["phases"])
    for ph in [*phases, None]:
        row: list[object] = [ph or "**step**"]
        for kind in ("wall", "non-matmul"):
            for label in labels:
                res = results[label]
                names = [ph] if ph else phases
                wall = sum(res["plain_ms"][n] for n in names)
                compute = sum(res["phases"][n]["compute"] for n in names)
                row.append(wall if kind == "wall" else wall - compute)
        rows.append(row)
    headers = ["phase", *[f"{x} wall ms" for x in labels]]
    headers += [f"{x} non-matmul ms" for x in labels]
    return markdown_table(headers, rows)


def compute_ms(res: dict) -> float:
    return sum(v["compute"] for v in res["phases"].values())


def summary_table(labels: list[str], results: dict[str, dict]) -> str:
    rows = []
    for label in labels:
        res = results[label]
        c = compute_ms(res)
        rows.append(
            [label, res["step_ms"], c, res["step_ms"] - c, res["cpu_ms"], res["profiled_step_ms"]]
        )
    headers = ["code", "step ms", "matmul/attention ms", "non-matmul ms"]
    headers += ["main-thread CPU ms", "step ms (profiled)"]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of the working tree")
    parser.add_argument(
        "--ref",
        action="append",
        default=[],
        help='a commit to measure (repeat for before/after; "." = the working tree), then '
        'config overrides for its runs: --ref "HEAD compile=true"; default: the working tree',
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per ref (interleaved)")
    parser.add_argument("--warm", type=int, default=3, help="first steps not measured")
    parser.add_argument("--plain", type=int, default=8, help="unprofiled steps measured")
    parser.add_argument("--profiled", type=int, default=6, help="profiled steps measured")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repo", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--top", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT=" + json.dumps(child(args)), flush=True)
        return
    if args.quick:
        args.runs, args.warm, args.plain, args.profiled = 1, 1, 2, 1
    load_before = load_average()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as tmp:
        tmp = Path(tmp)
        specs = {spec: spec.split() for spec in args.ref} or {"working tree": ["."]}
        trees: dict[str, Path] = {}
        for ref, *_ in specs.values():
            if ref not in trees:
                trees[ref] = REPO if ref == "." else export_ref(ref, tmp / "src")
        runs: dict[str, list[dict]] = {label: [] for label in specs}
        for i in range(args.runs):
            order = list(specs.items())
            for j, (label, (ref, *overrides)) in enumerate(order if i % 2 == 0 else order[::-1]):
                out = tmp / "runs" / f"{i}_{j}"
                runs[label].append(run_child(trees[ref], out, args, overrides))
    results = {label: median_result(r) for label, r in runs.items()}
    print(f"# Per-step overhead of `async_ppo --config tiny_cpu`\n\nmachine: {machine()}")
    print(f"load average at start: {load_before:.2f}; wall {time.perf_counter() - t0:.0f} s")
    print(
        f"{args.runs} run(s) per ref, interleaved; per run the median of {args.plain} plain and "
        f"{args.profiled} profiled steps after {args.warm} warm-up steps; medians over runs\n"
    )
    for label, res in results.items():
        print(f"## {label}: per-step milliseconds by phase (profiled)\n")
        print(phase_table(res) + "\n")
    print("## Summary (ms per step)\n")
    print(summary_table(list(results), results))
    if len(results) >= 2:
        print("\n## Per phase, side by side (ms per step)\n")
        print(comparison_table(list(results), results))
        before, after = next(iter(results)), list(results)[-1]
        a, b = (results[k]["step_ms"] - compute_ms(results[k]) for k in (before, after))
        print(f"\nnon-matmul time per step, {after} / {before}: {b / a:.2f}")


if __name__ == "__main__":
    main()
