"""What the behaviour-policy corrections cost (docs/corrections.md, "What each costs").

1. Memory traffic on a ~100M-parameter fp32 model (CPU): the EWMA update (one fused
   ``_foreach_lerp_`` per optimizer step), a snapshot save (``on_weights_published``) and a
   snapshot swap (save the actor's shards, load a snapshot, put the actor back), each against a
   plain ``torch._foreach_copy_`` of the same tensors. Goal: within 1.5× of the copy.
2. Bytes held per live snapshot version vs numel × element size (and the process RSS growth).
3. Extra forward passes per step of every method, for batches spanning 1, 2 and 3 versions.

    python benchmarks/correction_cost.py            # ~100M parameters
    python benchmarks/correction_cost.py --quick    # ~20M parameters, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from _common import rss_bytes

from minippo.models import ModelArgs, Transformer, qwen3_tiny
from minippo.parallel.weight_swap import local_shards
from minippo.rl.correction import (
    EWMA,
    TIS,
    KeepOldActor,
    LogLinearProx,
    NoCorrection,
    RolloutLogprobs,
)
from minippo.rl.types import RolloutBatch


def model_args(quick: bool) -> ModelArgs:
    base = qwen3_tiny()
    if quick:  # ~20M
        dims = {"vocab_size": 16_000, "dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
        dims |= {"head_dim": 64, "intermediate_size": 1536}
    else:  # ~110M
        dims = {"vocab_size": 32_000, "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4}
        dims |= {"head_dim": 64, "intermediate_size": 2048}
    return ModelArgs(**{**base.__dict__, **dims})


def paired(fn, baseline, repeats: int) -> tuple[float, float]:
    """(median seconds of ``fn``, median of fn / baseline), each run of ``fn`` timed right after
    one of ``baseline`` so that a busy machine slows both alike; one warm-up of each first."""
    fn()
    baseline()
    times, ratios = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        baseline()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        times.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(times), statistics.median(ratios)


def copy_costs(quick: bool) -> list[tuple[str, float, float]]:
    repeats = 5 if quick else 9
    model = Transformer(model_args(quick))
    shards = local_shards(model)
    numel = sum(t.numel() for t in shards)
    print(f"model: {numel / 1e6:.1f}M parameters, fp32 ({numel * 4 / 2**20:.0f} MiB)")
    dst = [torch.empty_like(t) for t in shards]

    def plain_copy():
        torch._foreach_copy_(dst, shards)

    ewma = EWMA(max_staleness=2, updates_per_step=4)
    ewma.on_weights_published(0, model)
    t_ewma = paired(lambda: ewma.after_optimizer_step(model), plain_copy, repeats)

    # snapshot save in the training loop's steady state: the previous version is evicted and its
    # buffers are reused by the next publish, which copies the weights into them
    koa = KeepOldActor(max_staleness=1_000_000)
    version = iter(range(10**9))

    def save():
        koa.on_weights_published(next(version), model)
        koa.retain([])  # keep only the latest: memory stays bounded during the benchmark

    t_save = paired(save, plain_copy, repeats)
    # swap cycle of one version (what prepare does around each forward): save the actor's
    # shards, load the snapshot, put the actor back = 3 copies of the model's bytes
    batch = tiny_batch([[0, 0]])

    def swap_cycle():
        koa.prepare(batch, model, step=0)

    koa = KeepOldActor()
    koa.on_weights_published(0, model)
    koa.score_fn = lambda m, b: torch.zeros(b.response_mask.shape)  # copies only, no forward
    t_swap = paired(swap_cycle, plain_copy, repeats)
    t_copy = paired(plain_copy, plain_copy, repeats)[0]
    gbps = numel * 4 * 2 / t_copy / 1e9
    print(f"plain _foreach_copy_: {t_copy * 1e3:.1f} ms ({gbps:.1f} GB/s read+write)")
    return [
        ("EWMA update (_foreach_lerp_)", *t_ewma),
        ("snapshot save (reused buffer + copy)", *t_save),
        ("snapshot swap cycle (3 copies)", *t_swap),
        ("  per copy (cycle / 3)", t_swap[0] / 3, t_swap[1] / 3),
    ]


def memory_case(quick: bool, dtype: str) -> None:
    """Run in a fresh process: print held, formula and RSS growth for 3 live versions."""
    model = Transformer(model_args(quick))
    numel = sum(t.numel() for t in local_shards(model))
    koa = KeepOldActor(storage_dtype=None if dtype == "fp32" else dtype, max_staleness=10)
    rss0 = rss_bytes()
    for v in range(3):
        koa.on_weights_published(v, model)
    size = 4 if dtype == "fp32" else 2
    print(json.dumps([koa.snapshot_bytes, 3 * numel * size, rss_bytes() - rss0]))


def memory_per_version(quick: bool) -> list[tuple[str, int, int, int]]:
    rows = []
    for dtype in ("fp32", "bf16"):
        cmd = [sys.executable, __file__, "--memory-case", dtype] + (["--quick"] if quick else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        held, formula, rss = json.loads(out.strip().splitlines()[-1])
        rows.append((f"3 versions, {dtype}", held, formula, rss))
    return rows


def tiny_batch(versions: list[list[int]], vocab: int = 64, prompt: int = 3) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    v = torch.tensor(versions)
    B, R = v.shape
    resp = (v >= 0).float()
    attn = torch.cat([torch.ones(B, prompt, dtype=torch.bool), resp.bool()], 1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=torch.randint(1, vocab, (B, prompt + R), generator=g),
        attention_mask=attn,
        position_ids=pos,
        response_mask=resp,
        rollout_logprobs=torch.full((B, R), -4.0),
        versions=v,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )


def forward_counts() -> dict[str, list[int]]:
    """Forward passes of prepare() per method for a batch spanning 1, 2, 3 versions (step 2)."""
    spans = {1: [[2, 2, 2], [2, 2, 2]], 2: [[1, 1, 2], [2, 2, 2]], 3: [[0, 1, 1], [2, 2, 2]]}
    out = {}
    for cls in (RolloutLogprobs, TIS, KeepOldActor, EWMA, LogLinearProx, NoCorrection):
        counts = []
        for versions in spans.values():
            model = Transformer(qwen3_tiny())
            calls = []
            model.tok_embeddings.register_forward_hook(lambda *a, c=calls: c.append(1))
            corr = cls(max_staleness=2, updates_per_step=4)
            for v in range(3):
                corr.on_weights_published(v, model)
            batch = tiny_batch(versions)
            if cls is EWMA:  # μ close to θ̄: no reset (a reset costs one more forward)
                with torch.no_grad():
                    lp = corr.score(model, batch)
                batch.rollout_logprobs = lp
                calls.clear()
            corr.prepare(batch, model, step=2)
            counts.append(len(calls))
        out[cls.method] = counts
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~20M parameters, fewer repeats")
    parser.add_argument("--memory-case", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.memory_case:
        memory_case(args.quick, args.memory_case)
        return

    print("\n## 1. time vs a plain copy of the same bytes (goal <= 1.5x)")
    print(f"{'operation':40s} {'ms':>9s} {'x copy (median of paired runs)':>32s}")
    for name, t, ratio in copy_costs(args.quick):
        print(f"{name:40s} {t * 1e3:9.1f} {ratio:32.2f}")

    print("\n## 2. snapshot memory (bytes held vs numel x element size)")
    print(f"{'case':22s} {'held':>14s} {'formula':>14s} {'RSS growth':>14s}")
    for name, held, formula, rss in memory_per_version(args.quick):
        print(f"{name:22s} {held:14,d} {formula:14,d} {rss:14,d}")

    print("\n## 3. extra forward passes in prepare() per step, batch spanning 1 / 2 / 3 versions")
    for method, counts in forward_counts().items():
        print(f"{method:18s} {' / '.join(map(str, counts))}")


if __name__ == "__main__":
    main()
