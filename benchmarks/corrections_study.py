"""The correction study: behaviour-policy corrections under staleness and a train/inference
discrepancy, on tiny CPU jobs (docs/study.md).

Every run is the real recipe through the CLI (``minippo run async_ppo --config tiny_cpu``), so
nothing of the training loop is duplicated here; this script only sets overrides, runs the grid
(several runs in parallel, one torch thread each) and reads each run's metrics.jsonl.

Axes:
    staleness    rollout.max_staleness (0 = the synchronous loop, where only ``none`` runs)
    regime       bound: the overlapped loop, where batches sit at the staleness bound;
                 partial: the colocated ``alternate`` schedule with rollout.oversample 1.5 and
                 partial rollouts, where a response carried over a publish mixes versions
    method       none (sync only), rollout_logprobs, tis, keep_old_actor, ewma (reset_below 0.8),
                 ewma_guard (the same with reset_guard: true), ewma_noreset (reset_below 1e-9: a
                 reset needs a retained fraction of exactly 0, i.e. it never fires),
                 loglinear_prox
    discrepancy  fp32: the engine computes in fp32 like the trainer (they agree to ~1e-6);
                 bf16: the engine computes in bfloat16 (engine.dtype=bf16: weights,
                 activations and KV cache; sampling in fp32 from the bf16 logits);
                 fp8 / int8 / int4: bf16 with the linear layers rounded as a quantized
                 serving engine rounds them (engine.quantize)
    seed         the run's seed (model init, prompts, sampling)

Per cell (mean over seeds): final reward (mean of the last ``--smooth`` steps, with a 95%
Student-t interval over the seeds), steps until the trailing mean reward reaches 80% of the
synchronous baseline's final reward, collapses, mean retained fraction, PPO clip fraction, EWMA
resets, mean and largest |a - mu|, the measured staleness histogram (from each step's
rollout/staleness_*; when a step's tokens have several staleness values, their mean and maximum
instead), the fraction of samples whose tokens span several versions, wall time, bytes held by the
correction, peak RSS. The synchronous baseline's per-step clip fraction and approximate KL
(median and 90th percentile) are printed as the calibration table.

    python benchmarks/corrections_study.py --quick                  # 2 short runs, seconds
    python benchmarks/corrections_study.py --staleness 0 4 --seeds 3 --jobs 2 --write-docs
    python benchmarks/corrections_study.py --config tiny_math_cpu --steps 400 --smooth 10 \
        --staleness 0 4 --regime bound partial --seeds 5 --jobs 2 --set eval=null
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from _common import (
    DEFAULT_OUT,
    TINY_CPU_AS_MEASURED,
    RecipeRun,
    ci95,
    correction_bytes,
    load_average,
    machine,
    markdown_table,
    run_recipe,
    save_figure,
)

C = "minippo.rl.correction."
METHODS: dict[str, list[str]] = {
    "none": ["~correction"],
    "rollout_logprobs": ["~correction", f"+correction._component_={C}RolloutLogprobs"],
    "tis": ["~correction", f"+correction._component_={C}TIS"],
    "keep_old_actor": ["~correction", f"+correction._component_={C}KeepOldActor"],
    "ewma": ["~correction", f"+correction._component_={C}EWMA", "+correction.reset_below=0.8"],
    "ewma_guard": [
        "~correction",
        f"+correction._component_={C}EWMA",
        "+correction.reset_below=0.8",
        "+correction.reset_guard=true",
    ],
    "ewma_noreset": [
        "~correction",
        f"+correction._component_={C}EWMA",
        "+correction.reset_below=1e-9",
    ],
    "loglinear_prox": ["~correction", f"+correction._component_={C}LogLinearProx"],
}
DISCREPANCY: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["engine.dtype=bf16"],
    # a quantized serving engine: bf16 compute from FP8 (weights per channel, activations per
    # token), int8 (weights per channel) or int4 (weights per group of 32) rounded linear
    # layers (engine.quantize, minippo.engine.quantize)
    "fp8": ["engine.dtype=bf16", "+engine.quantize=fp8"],
    "int8": ["engine.dtype=bf16", "+engine.quantize=int8"],
    "int4": ["engine.dtype=bf16", "+engine.quantize=int4"],
}
REGIMES: dict[str, list[str]] = {
    "bound": [],
    "partial": [
        "rollout.mode=alternate",
        "rollout.oversample=1.5",
        "rollout.partial_rollout=true",
        # every row in flight in one TorchEngine wave (48 groups x 8 samples on tiny_math_cpu):
        # with 256 the first wave holds exactly the batch's groups, the extra ones never start
        # before the stop and nothing is carried with tokens
        "engine.max_batch_size=512",
    ],
}
SMOOTH = 5  # default steps of the trailing mean ("final reward", "steps to 80%", collapses)


@dataclass(frozen=True)
class Cell:
    discrepancy: str
    staleness: int
    method: str
    regime: str = "bound"

    @property
    def name(self) -> str:
        tail = "" if self.regime == "bound" else f"_{self.regime}"
        return f"{self.discrepancy}_s{self.staleness}_{self.method}{tail}"

    @property
    def label(self) -> str:
        return self.method if self.regime == "bound" else f"{self.method} ({self.regime})"


def cells(
    staleness: list[int],
    methods: list[str],
    discrepancies: list[str],
    regimes: list[str] | tuple[str, ...] = ("bound",),
) -> list[Cell]:
    """The grid: staleness 0 runs only ``none`` (the synchronous baseline, once), async staleness
    runs every other method in every regime (``none`` is refused for an async run with a
    critic)."""
    out = []
    for d in discrepancies:
        for s in staleness:
            for reg in regimes if s > 0 else ("bound",):
                for m in methods:
                    if (s == 0) == (m == "none"):
                        out.append(Cell(d, s, m, reg))
    return out


def finished_cells(out: Path) -> list[Cell]:
    """The cells with a finished run under ``out/runs``, read back from their folder names
    (``{discrepancy}_s{staleness}_{method}[_{regime}]``), in the order :func:`cells` gives."""
    found = []
    for d in sorted((out / "runs").glob("*_s*_*")):
        if not any(d.glob("seed*/result.json")):
            continue
        disc, _, rest = d.name.partition("_s")
        st, _, method = rest.partition("_")
        regime = "bound"
        for reg in REGIMES:
            if reg != "bound" and method.endswith(f"_{reg}"):
                method, regime = method[: -len(reg) - 1], reg
        if disc in DISCREPANCY and st.isdigit() and method in METHODS:
            found.append(Cell(disc, int(st), method, regime))
    rank = {m: i for i, m in enumerate(METHODS)}
    disc_rank = {d: i for i, d in enumerate(DISCREPANCY)}
    return sorted(
        found, key=lambda c: (disc_rank[c.discrepancy], c.staleness, c.regime, rank[c.method])
    )


# settings a config has changed since the study's figures were measured: the values they had
MEASURED_WITH = {
    "tiny_cpu": [*TINY_CPU_AS_MEASURED, "optimizer.betas=[0.9,0.99]"],
    "tiny_math_cpu": ["kl.coef=0.05"],
}


def overrides(cell: Cell, seed: int, steps: int, extra: list[str], config: str) -> list[str]:
    return [
        f"seed={seed}",
        f"total_steps={steps}",
        f"rollout.max_staleness={cell.staleness}",
        "lr_scheduler.warmup_steps=0",  # the schedule the study's figures were measured with:
        f"lr_scheduler.total_steps={steps}",  # no warm-up, the cosine over the whole run
        *MEASURED_WITH.get(config, []),
        *METHODS[cell.method],
        *DISCREPANCY[cell.discrepancy],
        *REGIMES[cell.regime],
        *extra,
    ]


# ------------------------------------------------------------------------------------ analysis
def trailing_mean(xs: list[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def steps_to(rewards: list[float], threshold: float, smooth: int) -> int | None:
    """First step whose ``smooth``-step trailing mean reward reaches ``threshold`` (None if
    never)."""
    for i, r in enumerate(trailing_mean(rewards, smooth)):
        if r >= threshold:
            return i
    return None


def collapsed(run: RecipeRun, smooth: int, *, floor: float = 0.3, drop: float = 0.5) -> bool:
    """A failed run, or a trailing-mean reward that falls below ``drop`` x its running maximum
    after that maximum exceeded ``floor``."""
    if run.returncode != 0:
        return True
    best = 0.0
    for r in trailing_mean(run.series("rollout/reward_mean"), smooth):
        if best >= floor and r < drop * best:
            return True
        best = max(best, r)
    return False


def staleness_histogram(run: RecipeRun) -> tuple[Counter, bool]:
    """{staleness: steps} from each step's rollout/staleness_mean, and whether every step's
    tokens had one staleness (min == max; true without partial rollouts)."""
    hist: Counter = Counter()
    uniform = True
    for m in run.metrics:
        if "rollout/staleness_mean" in m:
            hist[round(m["rollout/staleness_mean"])] += 1
            uniform &= m["rollout/staleness_min"] == m["rollout/staleness_max"]
    return hist, uniform


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def summarize(cell: Cell, runs: list[RecipeRun], reference: float, smooth: int) -> dict:
    """The per-cell figures (means over seeds) of the table."""
    ok = [r for r in runs if r.returncode == 0 and r.metrics]
    final = [mean(r.series("rollout/reward_mean")[-smooth:]) for r in ok]
    reach = [steps_to(r.series("rollout/reward_mean"), 0.8 * reference, smooth) for r in ok]
    reached = [s for s in reach if s is not None]
    hist: Counter = Counter()
    uniform = True
    for r in ok:
        h, u = staleness_histogram(r)
        hist.update(h)
        uniform &= u
    stale_mean = [m for r in ok for m in r.series("rollout/staleness_mean")]
    stale_max = [m for r in ok for m in r.series("rollout/staleness_max")]
    clip = [
        mean(
            [
                a + b
                for a, b in zip(r.series("train/clip_frac_low"), r.series("train/clip_frac_high"))
            ]
        )
        for r in ok
    ]
    return {
        "cell": cell.name,
        "discrepancy": cell.discrepancy,
        "staleness": cell.staleness,
        "method": cell.method,
        "regime": cell.regime,
        "seeds": len(runs),
        "failed": len(runs) - len(ok),
        "final_reward": mean(final),
        "final_reward_sd": statistics.stdev(final) if len(final) > 1 else 0.0,
        "final_reward_ci95": ci95(final),
        "staleness_token_mean": mean(stale_mean),
        "staleness_max": max(stale_max, default=0.0),
        "multi_version": mean(
            [
                mean(r.series("rollout/multi_version_fraction"))
                for r in ok
                if r.series("rollout/multi_version_fraction")
            ]
        ),
        "steps_to_80": mean([float(s) for s in reached]),
        "reached_80": len(reached),
        "collapses": sum(collapsed(r, smooth) for r in runs),
        "retained": mean([mean(r.series("correction/retained_fraction")) for r in ok]),
        "retained_min": min(
            (min(r.series("correction/retained_fraction"), default=1.0) for r in ok), default=1.0
        ),
        "clip_frac": mean(clip),
        "ewma_resets": mean([max(r.series("correction/ewma_resets"), default=0.0) for r in ok]),
        "abs_diff": mean([mean(r.series("correction/abs_diff_mean")) for r in ok]),
        # the tail: each run's largest per-token |a - mu|, mean over seeds
        "abs_diff_max": mean([max(r.series("correction/abs_diff_max"), default=0.0) for r in ok]),
        "staleness_hist": dict(sorted(hist.items())),
        "staleness_uniform": uniform,
        "wall_s": mean([r.wall_s for r in runs]),
        "step_s": mean([mean(r.series("perf/step_s")) for r in ok]),
        "correction_bytes": max((correction_bytes(r) for r in ok), default=0.0),
        "maxrss_mib": mean([r.maxrss_mib for r in runs]),
        "final_rewards": final,
    }


def hist_text(h: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in h.items())


def table(rows: list[dict]) -> str:
    headers = [
        "staleness",
        "method",
        "final reward",
        "95% CI",
        "steps to 80% (reached)",
        "collapses",
        "retained",
        "clip frac",
        "EWMA resets",
        "mean \\|a-μ\\|",
        "max \\|a-μ\\|",
        "measured staleness (value:steps, or mixed)",
        "mixed-version samples",
        "wall s/run",
        "correction bytes",
        "peak RSS MiB",
    ]
    body = []
    for r in rows:
        steps = "—" if math.isnan(r["steps_to_80"]) else f"{r['steps_to_80']:.0f}"
        body.append(
            [
                r["staleness"],
                r["method"] if r["regime"] == "bound" else f"{r['method']} ({r['regime']})",
                f"{r['final_reward']:.3f} ± {r['final_reward_sd']:.3f}",
                f"± {r['final_reward_ci95']:.3f}",
                f"{steps} ({r['reached_80']}/{r['seeds'] - r['failed']})",
                f"{r['collapses']}/{r['seeds']}",
                f"{r['retained']:.3f}",
                f"{r['clip_frac']:.3f}",
                f"{r['ewma_resets']:.1f}" if r["method"].startswith("ewma") else "—",
                f"{r['abs_diff']:.4f}",
                f"{r['abs_diff_max']:.3f}",
                hist_text(r["staleness_hist"])
                if r["staleness_uniform"]
                else f"mixed: mean {r['staleness_token_mean']:.2f}, max {r['staleness_max']:.0f}",
                "—" if math.isnan(r["multi_version"]) else f"{r['multi_version']:.3f}",
                f"{r['wall_s']:.0f}",
                f"{r['correction_bytes']:,.0f}",
                f"{r['maxrss_mib']:.0f}",
            ]
        )
    return markdown_table(headers, body)


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics)."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (pos - lo) * (ys[hi] - ys[lo])


def calibration(runs: list[RecipeRun]) -> list[list]:
    """Per-optimizer-step PPO statistics of the synchronous baseline, pooled over seeds and steps:
    the figures to compare with the clip fractions and approximate KLs of LLM runs."""
    ok = [r for r in runs if r.returncode == 0 and r.metrics]
    clip = [
        a + b
        for r in ok
        for a, b in zip(r.series("train/clip_frac_low"), r.series("train/clip_frac_high"))
    ]
    rows = []
    for name, xs in (
        ("clip fraction", clip),
        ("approx KL (k3, nats/token)", [x for r in ok for x in r.series("train/approx_kl")]),
    ):
        rows.append(
            [
                name,
                f"{quantile(xs, 0.1):.4f}",
                f"{quantile(xs, 0.5):.4f}",
                f"{quantile(xs, 0.9):.4f}",
            ]
        )
    return rows


# ------------------------------------------------------------------------------------ plots
def plot(
    results: dict[Cell, list[RecipeRun]],
    out_dir: Path,
    write_docs: bool,
    smooth: int,
    tag: str = "",
) -> list[Path]:
    """Per engine: the reward curves (one panel per staleness), the seed's diagnostics over
    training (retained fraction and PPO clip fraction, one row of panels per staleness) and the
    EWMA retention before each reset decision; ``tag`` is added to the file names
    (``study_reward_<engine><tag>.png``) and, as words, to the titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    words = f", {tag.strip('_').replace('_', ' ')}" if tag else ""
    for disc in sorted({c.discrepancy for c in results}):
        mine = {c: r for c, r in results.items() if c.discrepancy == disc}
        stal = sorted({c.staleness for c in mine if c.staleness > 0})
        sync = [r for c, rs in mine.items() if c.staleness == 0 for r in rs if r.metrics]
        if not stal:
            continue
        order = sorted(mine, key=lambda c: (c.regime, c.method))
        fig, axes = plt.subplots(1, len(stal), figsize=(5 * len(stal), 3.6), squeeze=False)
        for ax, st in zip(axes[0], stal):
            for c in (c for c in order if c.staleness == st):
                _curve(ax, mine[c], "rollout/reward_mean", c.label, smooth)
            if sync:
                _curve(ax, sync, "rollout/reward_mean", "none (sync)", smooth, color="k", ls="--")
            ax.set_title(f"max_staleness {st}, engine {disc}{words}")
            ax.set_xlabel("step")
            ax.set_ylabel(f"reward ({smooth}-step mean, mean of seeds)")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="lower right")
        written += save_figure(fig, f"study_reward_{disc}{tag}.png", out_dir, write_docs)
        plt.close(fig)

        fig, axes = plt.subplots(len(stal), 2, figsize=(10, 3.5 * len(stal)), squeeze=False)
        for row, st in zip(axes, stal):
            for c in (c for c in order if c.staleness == st):
                _curve(row[0], mine[c], "correction/retained_fraction", c.label, smooth)
                _curve(row[1], mine[c], "train/clip_frac", c.label, smooth)
            if sync:
                _curve(row[1], sync, "train/clip_frac", "none (sync)", smooth, color="k", ls="--")
            row[0].set_title(
                f"retained fraction, max_staleness {st},\nengine {disc}{words}", fontsize=10
            )
            row[1].set_title(
                f"PPO clip fraction, max_staleness {st},\nengine {disc}{words}", fontsize=10
            )
            for ax in row:
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
        axes[0][1].legend(fontsize=7, loc="upper right")
        written += save_figure(fig, f"study_diagnostics_{disc}{tag}.png", out_dir, write_docs)
        plt.close(fig)

        ewma = [c for c in order if c.method.startswith("ewma")]
        if ewma:
            es = sorted({c.staleness for c in ewma})
            fig, axes = plt.subplots(1, len(es), figsize=(5 * len(es), 3.4), squeeze=False)
            for ax, st in zip(axes[0], es):
                for c in (c for c in ewma if c.staleness == st):
                    _curve(ax, mine[c], "correction/ewma_retained_before_reset", c.label, 1)
                ax.axhline(0.8, color="gray", lw=0.8, ls=":")
                ax.set_title(f"EWMA, max_staleness {st}, engine {disc}{words}")
                ax.set_xlabel("step")
                ax.set_ylabel("retained fraction (before reset)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            written += save_figure(
                fig, f"study_ewma_retention_{disc}{tag}.png", out_dir, write_docs
            )
            plt.close(fig)
    return written


def _series(run: RecipeRun, key: str) -> list[float]:
    """A metric per step; ``train/clip_frac`` is the sum of the low and high clip fractions."""
    if key == "train/clip_frac":
        return [
            a + b
            for a, b in zip(run.series("train/clip_frac_low"), run.series("train/clip_frac_high"))
        ]
    return run.series(key)


def _curve(ax, runs: list[RecipeRun], key: str, label: str, smooth: int, **kw) -> None:
    """Mean over seeds of the trailing mean, with the seeds' range shaded (failed runs left
    out: their short series would cut every curve at their last step)."""
    ok = [r for r in runs if r.returncode == 0]
    series = [trailing_mean(_series(r, key), smooth) for r in ok if _series(r, key)]
    if not series:
        return
    n = min(len(s) for s in series)
    avg = [statistics.fmean(s[i] for s in series) for i in range(n)]
    lo = [min(s[i] for s in series) for i in range(n)]
    hi = [max(s[i] for s in series) for i in range(n)]
    (line,) = ax.plot(range(n), avg, label=label, lw=1.4, **kw)
    ax.fill_between(range(n), lo, hi, color=line.get_color(), alpha=0.12)


# ------------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 runs x 3 small steps (CI)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 4, 8])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--discrepancy", nargs="+", default=["bf16"], choices=list(DISCREPANCY))
    p.add_argument("--regime", nargs="+", default=["bound"], choices=list(REGIMES))
    p.add_argument("--config", default="tiny_cpu", help="the recipe config every run starts from")
    p.add_argument(
        "--smooth", type=int, default=SMOOTH, help="steps of the trailing mean (final reward, ...)"
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60, help="total_steps of every run")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one thread each)")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "corrections_study")
    p.add_argument("--resume", action="store_true", help="reuse finished runs found in --out")
    p.add_argument("--write-docs", action="store_true", help="also save the PNGs in docs/img/")
    p.add_argument(
        "--figure-tag",
        default="",
        help="added to the figures' file names and titles, so that the figures of another "
        "regime do not replace these: --figure-tag _long_answers writes "
        "study_reward_int4_long_answers.png",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: report every finished run under --out/runs (the cells of several "
        "invocations together; --steps and --smooth as they ran)",
    )
    args = p.parse_args()
    extra = list(args.set)
    if args.quick:
        args.staleness, args.methods, args.seeds, args.steps = [0, 1], ["none", "ewma"], 1, 3
        extra += ["rollout.groups_per_batch=8", "ppo.micro_batch_size=8"]
        if args.out == DEFAULT_OUT / "corrections_study":
            args.out = DEFAULT_OUT / "corrections_study_quick"
        args.write_docs = False  # quick runs never touch docs/
    if args.steps < args.smooth:
        print(f"note: --steps {args.steps} < {args.smooth}: trailing means cover every step so far")

    if args.report:
        grid = finished_cells(args.out)
        args.discrepancy = sorted({c.discrepancy for c in grid}, key=list(DISCREPANCY).index)
        args.resume = True
        seeds_found = [len(list((args.out / "runs" / c.name).glob("seed*"))) for c in grid]
        args.seeds = max(seeds_found, default=0)
    else:
        grid = cells(args.staleness, args.methods, args.discrepancy, args.regime)
    if not grid:
        sys.exit(f"empty grid: staleness {args.staleness} x methods {args.methods}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    jobs = [(c, s) for s in seeds for c in grid]  # seed-major: a cut-short study has every cell
    if args.report:  # only the runs that finished (failed ones count as failed)
        jobs = [
            (c, s)
            for c, s in jobs
            if (args.out / "runs" / c.name / f"seed{s}" / "result.json").is_file()
        ]
    print(f"machine: {machine()}")
    print(
        f"{len(grid)} cells x {len(seeds)} seeds = {len(jobs)} runs of {args.steps} steps, "
        f"{args.jobs} in parallel; output {args.out}"
    )

    def one(job: tuple[Cell, int]) -> tuple[Cell, RecipeRun]:
        cell, seed = job
        d = args.out / "runs" / cell.name / f"seed{seed}"
        cached = d / "result.json"
        if args.resume and cached.is_file():
            data = json.loads(cached.read_text())
            ok = data["returncode"] == 0 and len(data["metrics"]) == args.steps
            if ok or args.report:
                return cell, RecipeRun(**{**data, "out_dir": Path(data["out_dir"])})
        run = run_recipe(
            overrides(cell, seed, args.steps, extra, args.config), d, config=args.config
        )
        cached.write_text(json.dumps({**run.__dict__, "out_dir": str(run.out_dir)}))
        status = "ok" if run.returncode == 0 else f"FAILED rc={run.returncode}"
        print(
            f"  {cell.name} seed {seed}: {status}, {run.wall_s:.0f} s, load {load_average():.1f}",
            flush=True,
        )
        if run.returncode != 0:
            print(run.log_tail, flush=True)
        return cell, run

    t0 = time.perf_counter()
    results: dict[Cell, list[RecipeRun]] = {c: [] for c in grid}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for cell, run in pool.map(one, jobs):
            results[cell].append(run)
    print(f"grid done in {time.perf_counter() - t0:.0f} s; load average {load_average():.2f}")

    rows = []
    for disc in args.discrepancy:
        base = [
            mean(r.series("rollout/reward_mean")[-args.smooth :])
            for c, rs in results.items()
            if c.discrepancy == disc and c.staleness == 0
            for r in rs
            if r.returncode == 0 and r.metrics
        ]
        # without a synchronous baseline in the grid, "80%" is of the best possible reward, 1.0
        reference = mean(base) if base else 1.0
        mine = [
            summarize(c, results[c], reference, args.smooth) for c in grid if c.discrepancy == disc
        ]
        rows += mine
        print(
            f"\n### engine {disc}: 80% threshold = 0.8 x {reference:.3f} "
            f"({'synchronous baseline final reward' if base else 'max reward'})"
        )
        print(table(mine))
        sync = [
            r for c, rs in results.items() if c.discrepancy == disc and c.staleness == 0 for r in rs
        ]
        if sync:
            print(f"\ncalibration, engine {disc}: the synchronous baseline, per training step")
            print(markdown_table(["statistic", "p10", "median", "p90"], calibration(sync)))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    for path in plot(results, args.out, args.write_docs, args.smooth, args.figure_tag):
        print(f"plot: {path}")
    failed = sum(r["failed"] for r in rows)
    if failed:
        sys.exit(f"{failed} run(s) failed; see run.log in {args.out / 'runs'}")


if __name__ == "__main__":
    main()
