"""TorchEngine's kernel caches under responses of varied length: decode speed and process memory
by ``engine.onednn_cache_capacity``.

The engine process runs every linear layer through oneDNN, whose primitive cache (and ideep's
kernel cache beside it) keeps one kernel per (layer, input shape). When all rows of a wave end
together the batch has few shapes; when responses end at varied lengths (stop tokens), the
compaction of finished rows and the re-prefills give a new batch size at almost every decode
step, and both caches fill up to their capacity.

One engine process per capacity, all holding the same model (engine_throughput's Qwen3, 4 layers,
hidden 256, vocab 32k, random weights), each with one thread. The same waves go to each engine in
turn (engine A wave 1, engine B wave 1, ..., engine A wave 2, ...): ``--batch`` requests per wave
with prompt lengths from 8 to 40 tokens and max_new_tokens from 1 to ``--new-tokens`` (seeded).
Reported per capacity: the median wave's generated tokens/s, its ratio to the largest capacity,
and the engine process's resident memory (VmRSS) after each wave: at the end and its peak (VmHWM).

    python benchmarks/engine_kernel_cache.py                    # capacities 1024 256 64
    python benchmarks/engine_kernel_cache.py --quick            # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine.torch_engine import TorchEngine

try:
    from benchmarks.engine_throughput import torch_engine, twin_models
except ImportError:  # run as a script from benchmarks/
    from engine_throughput import torch_engine, twin_models


def wave_requests(wave: int, batch: int, new_tokens: int, vocab: int) -> list[GenerateRequest]:
    """``batch`` requests of random prompt length (8-40) and max_new_tokens (1-new_tokens)."""
    rng = random.Random(wave)
    out = []
    for i in range(batch):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(8, 40))]
        params = SamplingParams(temperature=1.0, max_new_tokens=rng.randint(1, new_tokens))
        out.append(GenerateRequest(prompt, replace(params, seed=wave * batch + i), f"w{wave}r{i}"))
    return out


def process_memory_mb(engine: TorchEngine) -> tuple[float, float]:
    """(VmRSS, VmHWM) of the engine process in MiB."""
    fields = {}
    with open(f"/proc/{engine._process.pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--capacities", type=int, nargs="+", default=[1024, 256, 64])
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="2 capacities, 2 small waves")
    args = ap.parse_args()
    if args.quick:
        args.capacities, args.waves, args.batch, args.new_tokens = [1024, 64], 2, 8, 8
    vocab, dim, layers = 32_000, 256, 4
    _, model = twin_models(vocab=vocab, dim=dim, layers=layers)
    engines = {
        c: torch_engine(model, num_threads=1, onednn_cache_capacity=c) for c in args.capacities
    }
    speeds: dict[int, list[float]] = {c: [] for c in args.capacities}
    rss: dict[int, list[float]] = {c: [] for c in args.capacities}
    try:
        for wave in range(args.waves):
            requests = wave_requests(wave, args.batch, args.new_tokens, vocab)
            order = args.capacities if wave % 2 == 0 else args.capacities[::-1]
            for c in order:
                t0 = time.perf_counter()
                outs = engines[c].generate(requests)
                dt = time.perf_counter() - t0
                speeds[c].append(sum(len(o.token_ids) for o in outs) / dt)
                rss[c].append(process_memory_mb(engines[c])[0])
        peaks = {c: process_memory_mb(engines[c])[1] for c in args.capacities}
    finally:
        for e in engines.values():
            e.shutdown()
    ref = statistics.median(speeds[args.capacities[0]])
    print(
        f"{args.waves} waves x {args.batch} requests, prompts 8-40 tokens, max_new_tokens "
        f"1-{args.new_tokens}; Qwen3 {layers} layers, hidden {dim}, vocab {vocab}; 1 thread each\n"
    )
    print(
        "| onednn_cache_capacity | tok/s (median wave) | vs first "
        "| RSS after wave 1 / last, MiB | peak RSS MiB |"
    )
    print("|---:|---:|---:|---:|---:|")
    for c in args.capacities:
        med = statistics.median(speeds[c])
        print(
            f"| {c} | {med:,.0f} | {med / ref:.2f}x | {rss[c][0]:.0f} / {rss[c][-1]:.0f} | "
            f"{peaks[c]:.0f} |"
        )


if __name__ == "__main__":
    main()
