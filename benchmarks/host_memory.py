"""Peak host memory per rank while a 2-rank run builds its sharded actor from an HF folder.

    python benchmarks/host_memory.py            # ~110M-parameter Qwen3 shape, 3 A/B rounds
    python benchmarks/host_memory.py --quick    # a small model, 1 round (CI smoke)

A (before): what the recipe did until the meta-device build: every rank reads the whole
checkpoint into a full fp32 model on the host (``from_pretrained``), then shards it with FSDP2.
B (now, the recipe's ``_build_model``): build on the meta device, shard, ``to_empty``, then
``load_pretrained_weights`` reads the folder one tensor at a time and each rank keeps its shard.

Each variant runs as a fresh 2-rank torchrun job (gloo, CPU); every rank reports its peak resident
set (``ru_maxrss``) after the build and its resident set right after ``import torch`` and the
process group (the baseline both variants share). Runs alternate A, B, A, B, ...; the table gives
medians over rounds and the ratio of the model-attributable part (peak - baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine, markdown_table

WORKER = r"""
import json, os, resource, sys
import torch
import torch.distributed as dist
from minippo.models import Transformer, from_pretrained, load_pretrained_weights, model_args_from_pretrained
from minippo.parallel import init_distributed, shard_model

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

variant, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
info = init_distributed()
base = rss_mib()
if variant == "A":
    model = from_pretrained(path, dtype=torch.float32, device="cpu")
    shard_model(model)
else:
    with torch.device("meta"):
        model = Transformer(model_args_from_pretrained(path))
    shard_model(model)
    model.to_empty(device="cpu")
    load_pretrained_weights(model, path)
dist.barrier()
local = sum(p.to_local().numel() for p in model.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
    json.dump({"rank": info.rank, "base": base, "peak": peak, "local": local}, f)
dist.destroy_process_group()
"""


def make_checkpoint(folder: Path, quick: bool) -> int:
    """A random Qwen3-shaped HF folder (bf16 on disk, as released checkpoints are)."""
    import torch

    from minippo.models import ModelArgs, Transformer, init_weights, save_pretrained

    args = ModelArgs(
        vocab_size=32000 if not quick else 4096,
        dim=768 if not quick else 128,
        n_layers=12 if not quick else 2,
        n_heads=12 if not quick else 4,
        n_kv_heads=4 if not quick else 2,
        head_dim=64 if not quick else 32,
        intermediate_size=2048 if not quick else 256,
        max_seq_len=1024,
        tie_word_embeddings=False,
    )
    model = init_weights(Transformer(args), seed=0).to(torch.bfloat16)
    save_pretrained(model, folder)
    return sum(p.numel() for p in model.parameters())


def run_variant(variant: str, folder: Path, port: int) -> list[dict]:
    out = Path(tempfile.mkdtemp())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "--no-python",
            sys.executable,
            "-c",
            WORKER,
            variant,
            str(folder),
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(rows) != 2:
        raise RuntimeError(
            f"variant {variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, one round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rounds = 1 if a.quick else a.rounds
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        n = make_checkpoint(folder, a.quick)
        results: dict[str, list[list[dict]]] = {"A": [], "B": []}
        port = 29_611
        for r in range(rounds):
            for variant in ("A", "B"):
                port += 1
                results[variant].append(run_variant(variant, folder, port))
                peaks = [f"{x['peak']:.0f}" for x in results[variant][-1]]
                print(f"round {r + 1} {variant}: peak RSS per rank {peaks} MiB", flush=True)
    fp32_mib = n * 4 / 2**20
    rows = []
    for variant, label in (
        ("A", "full fp32 model per rank, then shard"),
        ("B", "meta + per-tensor load"),
    ):
        for rank in (0, 1):
            peak = statistics.median(run[rank]["peak"] for run in results[variant])
            base = statistics.median(run[rank]["base"] for run in results[variant])
            rows.append([label, rank, f"{base:.0f}", f"{peak:.0f}", f"{peak - base:.0f}"])
    print(
        f"\nmodel: {n / 1e6:.1f}M parameters ({fp32_mib:.0f} MiB in fp32, half per rank as shards)"
    )
    print(f"machine: {machine()}; {rounds} round(s), medians\n")
    print(
        markdown_table(
            ["build", "rank", "baseline MiB", "peak RSS MiB", "peak - baseline MiB"], rows
        )
    )
    a_extra = statistics.median(
        run[r]["peak"] - run[r]["base"] for run in results["A"] for r in (0, 1)
    )
    b_extra = statistics.median(
        run[r]["peak"] - run[r]["base"] for run in results["B"] for r in (0, 1)
    )
    print(f"\nratio (peak - baseline), before / now: {a_extra / max(b_extra, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
