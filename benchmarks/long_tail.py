"""Over-provisioned streaming groups on long-tailed response lengths: ``rollout.mode: alternate``
with ``oversample`` 1.0 (every step waits for its slowest group) vs 1.25 and 1.5.

The real TorchEngine (in-process, one torch thread, ``qwen3_tiny`` with random weights) is driven
by the real RolloutQueue in alternate mode, step by step as the recipe drives it: ``queue.publish(weights,
version=step)``, then ``queue.get_batch(step)`` (the same weights each step; the versions go up by
one per step).

Response lengths are controlled, not sampled: there are no stop ids, and a thin wrapper around the
engine (:class:`LengthTableEngine`) rewrites each request's ``max_new_tokens`` from a fixed table
of lengths keyed by (group index, sample j, restart count), read from the queue's request ids
(``g{index}-n{j}-a{restarts}-s{step}``). The table draws lognormal lengths whose p99 / p50 is 9 (median
``--median`` tokens, capped at 24 medians). A request that continues a carried sample asks only
for the rest (its prompt is longer than the group's prompt by the tokens already generated), so
every trained sample ends exactly at its drawn length, which the script checks. A sample that the
staleness bound restarts is a new response (the queue gives it a new seed), so by default its
length is drawn again (``--restarts redraw``); ``--restarts keep`` gives it the same length, the
worst case: a response longer than the bound allows never finishes and its group holds a slot
for good.

Cost unit: engine decode steps (``TorchEngine.stats()["decode_steps"]``) per trained sample. All
in-flight requests decode in one wave (``max_batch_size`` holds them all); on a GPU a decode step
costs about the same at any of these batch sizes, so decode steps measure the rollout time there.
The wall time per trained sample on this CPU is reported too, with the tokens generated per
trained token (restarted work and carried work count as generated).

Each run: ``--warmup`` steps, then ``--steps`` measured steps, ``max_staleness=1`` (the queue
raises if a batch breaks the bound). The warm-up matters: the groups that cannot finish within the
bound (a carried sample has two steps) restart and pile up in the spare slots over the first
~100 steps, and a short run measures the better start. Oversample 1.0 carries nothing from step
to step and runs no warm-up. Every repeat draws a new length table (seed = repeat) and runs all
the oversample values on it, in a rotating order; the table gives medians over repeats.

    python benchmarks/long_tail.py               # 16 groups x 4, 5 repeats: ~11 min on 2 busy cores
    python benchmarks/long_tail.py --repeats 3   # the first 3 of those repeats
    python benchmarks/long_tail.py --quick       # 8 x 2, 1 short repeat (seconds)
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist

import torch

from minippo.engine import GenerateRequest, SamplingParams, TorchEngine
from minippo.engine.protocol import Completion
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.parallel import full_tensor_buckets
from minippo.training.rollout_queue import RolloutQueue

try:
    from _common import machine, markdown_table
except ImportError:  # imported from the repository root (tests)
    from benchmarks._common import machine, markdown_table

TAIL_RATIO = 9.0  # p99 / p50 of the length distribution (the spec: 8-10)
Z99 = NormalDist().inv_cdf(0.99)
_REQUEST_ID = re.compile(r"g(\d+)-n(\d+)-a(\d+)-s(\d+)-o(\d+)")


class LengthTable:
    """Response lengths keyed by (group index, sample j, restart count): lognormal with median
    ``median`` and p99 / p50 = ``TAIL_RATIO``, rounded, between 1 and ``cap``; each key draws
    from its own ``random.Random`` seeded by ``(seed, group, j, attempt)``, so a length never
    depends on which keys were asked before. ``redraw=False``: the restart count is ignored."""

    def __init__(self, median: float, cap: int, seed: int, redraw: bool = True) -> None:
        self.mu = math.log(median)
        self.sigma = math.log(TAIL_RATIO) / Z99
        self.cap = cap
        self.seed = seed
        self.redraw = redraw

    def __call__(self, group: int, j: int, attempt: int) -> int:
        key = f"{self.seed}:{group}:{j}" + (f":{attempt}" if self.redraw else "")
        draw = random.Random(key).lognormvariate(self.mu, self.sigma)
        return max(1, min(self.cap, round(draw)))


def prompt_ids(group: int, vocab: int) -> list[int]:
    """The prompt of group ``group``: 8 to 24 token ids, fixed by the group index."""
    rng = random.Random(f"prompt:{group}")
    return [rng.randrange(1, vocab) for _ in range(8 + group % 17)]


def prompts(vocab: int) -> Iterator[dict]:
    """The prompt source: group ``i`` gets ``prompt_ids(i)`` (the queue numbers groups in the
    order it takes prompts, from 0)."""
    i = 0
    while True:
        yield {"prompt_ids": prompt_ids(i, vocab)}
        i += 1


class LengthTableEngine:
    """A TorchEngine whose requests end at the table's lengths: each request's
    ``max_new_tokens`` becomes ``lengths(group, j)`` minus the tokens the sample already has
    (a continued request's prompt is the group's prompt plus those tokens). Everything else is
    the wrapped engine's."""

    def __init__(self, engine: TorchEngine, lengths: LengthTable, vocab: int) -> None:
        self._engine = engine
        self._lengths = lengths
        self._vocab = vocab
        self._prompt_len: dict[int, int] = {}

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def _rewrite(self, r: GenerateRequest) -> GenerateRequest:
        m = _REQUEST_ID.fullmatch(r.request_id)
        if m is None:
            raise ValueError(
                f"request id {r.request_id!r} is not the RolloutQueue's "
                "g<index>-n<j>-a<restarts>-s<step>-o<offset>"
            )
        group, j, attempt = int(m[1]), int(m[2]), int(m[3])
        if group not in self._prompt_len:
            self._prompt_len[group] = len(prompt_ids(group, self._vocab))
        done = len(r.prompt_ids) - self._prompt_len[group]
        rest = self._lengths(group, j, attempt) - done
        if done < 0 or rest < 1:
            raise RuntimeError(
                f"request {r.request_id}: {done} tokens already generated of a drawn length of "
                f"{self._lengths(group, j, attempt)}; a finished sample must not be continued"
            )
        return replace(r, params=replace(r.params, max_new_tokens=rest))

    def stream(
        self, requests: Sequence[GenerateRequest], *, until_groups: int | None = None
    ) -> Iterator[Completion]:
        return self._engine.stream([self._rewrite(r) for r in requests], until_groups=until_groups)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        return self._engine.generate([self._rewrite(r) for r in requests])


@dataclass
class RunResult:
    """One run's measured steps (its warm-up steps excluded)."""

    oversample: float
    steps: int = 0
    decode_steps: int = 0  # engine decode steps
    row_steps: int = 0  # rows summed over decode steps = tokens generated
    trained_samples: int = 0
    trained_tokens: int = 0
    wall_s: float = 0.0  # publish + get_batch
    restarted: int = 0  # rollout/restarted, summed
    multi_version: list[float] = field(default_factory=list)  # per step: samples of 2 versions
    staleness_max: float = 0.0
    carried_max: int = 0  # groups carried into the next step
    lengths: list[int] = field(default_factory=list)  # of the trained samples

    @property
    def per_sample(self) -> float:
        """Decode steps per trained sample."""
        return self.decode_steps / self.trained_samples


def run(
    weights: list,
    lengths: LengthTable,
    *,
    oversample: float,
    groups: int,
    samples: int,
    warmup: int,
    steps: int,
    seed: int,
) -> RunResult:
    """``warmup + steps`` steps of publish / get_batch on a fresh engine; measure the last
    ``steps``. Raises if a trained sample does not end at its drawn length."""
    args = qwen3_tiny()
    in_flight = math.ceil(groups * oversample - 1e-9)
    engine = TorchEngine(args, in_process=True, max_batch_size=in_flight * samples, seed=seed)
    queue = RolloutQueue(
        LengthTableEngine(engine, lengths, args.vocab_size),
        prompts(args.vocab_size),
        groups_per_batch=groups,
        samples_per_prompt=samples,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=lengths.cap),
        max_staleness=1,
        partial_rollout=True,
        mode="alternate",
        oversample=oversample,
        seed=seed,
    )
    res = RunResult(oversample, steps=steps)
    try:
        queue.start()
        before = engine.stats()
        for step in range(warmup + steps):
            if step == warmup:
                before = engine.stats()
            t0 = time.perf_counter()
            queue.publish(weights, version=step)
            out = queue.get_batch(step)
            dt = time.perf_counter() - t0
            for s in out.samples:
                c = s.completion
                g, j, attempt = (int(x) for x in _REQUEST_ID.fullmatch(c.request_id).groups()[:3])
                if len(c.token_ids) != lengths(g, j, attempt) or c.finish_reason != "length":
                    raise RuntimeError(
                        f"sample {c.request_id}: {len(c.token_ids)} tokens ({c.finish_reason}), "
                        f"drawn length {lengths(g, j, attempt)}"
                    )
            if step < warmup:
                continue
            m = out.metrics
            res.wall_s += dt
            res.trained_samples += len(out.samples)
            res.lengths += [len(s.completion.token_ids) for s in out.samples]
            res.restarted += int(m["rollout/restarted"])
            res.multi_version.append(m["rollout/multi_version_fraction"])
            res.staleness_max = max(res.staleness_max, m["rollout/staleness_max"])
            res.carried_max = max(res.carried_max, int(m["rollout/carried_over"]))
        after = engine.stats()
    finally:
        queue.close()
        engine.shutdown()
    res.trained_tokens = sum(res.lengths)
    res.decode_steps = after["decode_steps"] - before["decode_steps"]
    res.row_steps = after["row_steps"] - before["row_steps"]
    return res


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (linear interpolation between order statistics)."""
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 groups x 2 samples, short runs")
    ap.add_argument("--groups", type=int, default=16, help="groups_per_batch")
    ap.add_argument("--samples", type=int, default=4, help="samples_per_prompt")
    ap.add_argument("--median", type=float, default=8.0, help="median response length (tokens)")
    ap.add_argument("--warmup", type=int, default=100, help="steps before the measured ones")
    ap.add_argument("--steps", type=int, default=50, help="measured steps per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--restarts",
        choices=("redraw", "keep"),
        default="redraw",
        help="length of a restarted sample: drawn again (a new response) or kept (worst case)",
    )
    ap.add_argument(
        "--oversample", type=float, nargs="+", default=[1.0, 1.25, 1.5], help="first = baseline"
    )
    args = ap.parse_args()
    if args.quick:
        args.groups, args.samples, args.median = 8, 2, 8.0
        args.warmup, args.steps, args.repeats = 4, 4, 1
    if any(o < 1 for o in args.oversample):
        raise SystemExit(f"--oversample: every value must be >= 1.0, got {args.oversample}")
    torch.set_num_threads(1)

    model = init_weights(Transformer(qwen3_tiny()), seed=0)
    weights = list(full_tensor_buckets(model, bucket_bytes=1 << 26, dtype=torch.float32))
    cap = round(24 * args.median)
    results: dict[float, list[RunResult]] = {o: [] for o in args.oversample}
    t_start = time.perf_counter()
    # untimed: the first engine's one-time costs (allocator, kernel set-up) fall here
    run(
        weights,
        LengthTable(args.median, cap, seed=-1),
        oversample=1.0,
        groups=2,
        samples=2,
        warmup=0,
        steps=2,
        seed=0,
    )
    for rep in range(args.repeats):
        lengths = LengthTable(args.median, cap, seed=rep, redraw=args.restarts == "redraw")
        k = rep % len(args.oversample)
        for o in args.oversample[k:] + args.oversample[:k]:  # rotating order
            res = run(
                weights,
                lengths,
                oversample=o,
                groups=args.groups,
                samples=args.samples,
                warmup=args.warmup if o > 1 else 0,  # oversample 1.0 carries nothing
                steps=args.steps,
                seed=rep,
            )
            results[o].append(res)
            print(
                f"repeat {rep}, oversample {o:g}: {res.per_sample:.3f} decode steps per trained "
                f"sample ({time.perf_counter() - t_start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    total_s = time.perf_counter() - t_start

    base = args.oversample[0]
    print(f"machine: {machine()}")
    print(
        f"model: qwen3_tiny (fp32), TorchEngine in-process, torch threads 1; {args.groups} groups "
        f"x {args.samples} samples per batch, max_staleness 1; per run {args.warmup} warm-up "
        f"steps (none at oversample 1) + {args.steps} measured; {args.repeats} repeats, a new "
        f"length table each, oversample order rotating; restarted samples: {args.restarts} "
        f"their length; total {total_s:.0f} s"
    )
    drawn = [n for r in results[base] for n in r.lengths]
    table = LengthTable(args.median, cap, seed=10_000)
    big = [table(g, j, 0) for g in range(5_000) for j in range(4)]
    for name, xs in (
        (f"the oversample {base:g} runs' trained samples (n={len(drawn)})", drawn),
        (f"a length table (n={len(big)})", big),
    ):
        p50, p99 = percentile(xs, 0.5), percentile(xs, 0.99)
        print(
            f"lengths, {name}: p50 {p50:.1f}, p99 {p99:.1f}, p99/p50 {p99 / p50:.2f}, "
            f"mean {statistics.mean(xs):.2f}, max {max(xs)}"
        )

    def med(o: float, f) -> float:
        return statistics.median(f(r) for r in results[o])

    rows = []
    for o in args.oversample:
        per = [r.per_sample for r in results[o]]
        rows.append(
            [
                f"{o:g}",
                med(o, lambda r: r.per_sample),
                f"{min(per):.3g}-{max(per):.3g}",
                med(o, lambda r: r.row_steps / r.trained_tokens),
                med(o, lambda r: r.trained_tokens / r.trained_samples),
                med(o, lambda r: 1e3 * r.wall_s / r.trained_samples),
                med(o, lambda r: r.restarted / r.steps),
                med(o, lambda r: statistics.mean(r.multi_version)),
                max(r.staleness_max for r in results[o]),
                max(r.carried_max for r in results[o]),
            ]
        )
    print()
    print(
        markdown_table(
            [
                "oversample",
                "decode steps / trained sample",
                "min-max",
                "tokens generated / trained",
                "trained length",
                "wall ms / trained sample",
                "restarted / step",
                "multi-version fraction",
                "staleness max",
                "carried max",
            ],
            rows,
        )
    )
    print("(medians over the repeats; min-max: over the repeats)")
    print()
    print(
        markdown_table(
            ["repeat", *(f"oversample {o:g}" for o in args.oversample), f"{base:g} / best"],
            [
                [
                    rep,
                    *(results[o][rep].per_sample for o in args.oversample),
                    results[base][rep].per_sample
                    / min(results[o][rep].per_sample for o in args.oversample),
                ]
                for rep in range(args.repeats)
            ],
        )
    )
    print("(decode steps per trained sample, per repeat)")

    best = min(args.oversample, key=lambda o: med(o, lambda r: r.per_sample))
    wall = {o: med(o, lambda r: r.wall_s / r.trained_samples) for o in args.oversample}
    print(
        f"\nfewest decode steps per trained sample: oversample {best:g}; wall time per trained "
        f"sample on this CPU, oversample {base:g} / {best:g}: {wall[base] / wall[best]:.2f}x"
    )
    print(f"ratio: {med(base, lambda r: r.per_sample) / med(best, lambda r: r.per_sample):.2f}")


if __name__ == "__main__":
    main()
