"""Peak memory and step time per optimizer choice: torch AdamW vs torchao AdamW8bit / AdamW4bit.

Two measurements per optimizer, each reported as a ratio to torch AdamW (fused):

1. The tiny CPU job: the async_ppo recipe on configs/tiny_cpu.yaml (actor and critic use the
   optimizer). Memory: the peak of live tensor bytes in the trainer process
   (``TensorMemoryTracker``) from setup to the last step, and the bytes of the optimizers' state.
   Time: the median ``perf/train_s`` (the PPO-update phase) over the steps after the first, from
   a second run without the tracker (torch.compile, which torchao uses for its step, does not run
   under a tensor-tracking dispatch mode; the tracked run uses the same step eagerly).
2. A parameter-heavy step loop: a ~4M-parameter Qwen3-shaped decoder trained on a fixed batch, where
   the optimizer state is a large share of memory. Same two measurements.

    python benchmarks/optimizer_memory.py --quick      # smoke run (eager, no timings), ~1 min
    python benchmarks/optimizer_memory.py              # the numbers in docs/benchmarks.md

Prints a markdown table per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from _common import DEFAULT_OUT, QUIET_RUN, REPO, TensorMemoryTracker, machine

from minippo.config import load_config
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.training.metrics import read_jsonl
from minippo.training.optimizers import build_optimizer

OPTIMIZERS = [
    ("torch AdamW (fused)", "minippo.training.optimizers.AdamW"),
    ("torchao AdamW8bit", "torchao.optim.AdamW8bit"),
    ("torchao AdamW4bit", "torchao.optim.AdamW4bit"),
]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every storage in the optimizer state (quantized states: codes, scales, tables)."""
    tracker = TensorMemoryTracker().track(opt)
    return tracker.current.get("cpu", 0)


def _eager(on: bool):
    return torch.compiler.set_stance("force_eager") if on else nullcontext()


# ------------------------------------------------------------------ 1. the tiny job (the recipe)


def recipe_run(component: str, steps: int, tracked: bool) -> dict:
    recipe = runpy.run_path(str(REPO / "recipes" / "async_ppo.py"), run_name="bench")
    # one folder per optimizer and mode, reused by later runs (no temporary folders left behind)
    out_dir = DEFAULT_OUT / "optimizer_memory" / f"{component}_{'tracked' if tracked else 'timed'}"
    node = f"{{_component_: {component}, lr: 3.0e-3, weight_decay: 0.0}}"
    cfg = load_config(
        REPO / "configs" / "tiny_cpu.yaml",
        [
            f"total_steps={steps}",
            f"output_dir={out_dir}",
            *QUIET_RUN,
            f"optimizer={node}",
            f"critic.optimizer={node}",
        ],
    )
    run = recipe["AsyncPPORecipe"](cfg)
    tracker = TensorMemoryTracker()
    try:
        with tracker if tracked else nullcontext(), _eager(tracked):
            run.setup(cfg)
            run.train()
        states = state_bytes(run.optimizer) + state_bytes(run.critic_optimizer)
    finally:
        run.cleanup()
    rows = read_jsonl(cfg.metric_logger.path)
    train_s = [r["perf/train_s"] for r in rows if "perf/train_s" in r][1:]
    return {
        "peak": tracker.peak.get("cpu", 0) if tracked else None,
        "states": states,
        "train_s": statistics.median(train_s) if train_s else float("nan"),
    }


# ------------------------------------------------------------------ 2. a parameter-heavy loop


def heavy_args():
    return dataclasses.replace(
        qwen3_tiny(vocab_size=2048),
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        intermediate_size=768,
        tie_word_embeddings=False,
    )


def loop_run(component: str, steps: int, tracked: bool) -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    tracker = TensorMemoryTracker()
    times, losses = [], []
    with tracker if tracked else nullcontext(), _eager(tracked):
        model = init_weights(Transformer(heavy_args()))
        opt = build_optimizer(
            {"_component_": component, "lr": 1e-3, "weight_decay": 0.0}, model.parameters()
        )
        for _ in range(steps):
            t = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
    return {
        "peak": tracker.peak.get("cpu", 0) if tracked else None,
        "states": state_bytes(opt),
        "step_s": statistics.median(times[1:]),
        "params": sum(p.numel() for p in model.parameters()),
        "loss": (losses[0], losses[-1]),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(title: str, results: dict, time_key: str) -> str:
    base = results[OPTIMIZERS[0][0]]
    lines = [
        f"**{title}**",
        "",
        f"| optimizer | state MiB | x AdamW | peak MiB | x AdamW | {time_key} | x AdamW |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _ in OPTIMIZERS:
        r = results[name]
        lines.append(
            f"| {name} | {_mib(r['states'])} | {r['states'] / base['states']:.3f} | "
            f"{_mib(r['peak'])} | {r['peak'] / base['peak']:.3f} | {r[time_key]:.4f} | "
            f"{r[time_key] / base[time_key]:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    args = parser.parse_args()
    # --quick is a smoke run: 2 recipe steps, one (tracked, eager) run per optimizer, no timings
    # worth reading; the full run times the compiled torchao step in a second, untracked run
    recipe_steps, loop_steps = (2, 3) if args.quick else (10, 20)
    print(f"machine: {machine()}")
    print(f"{torch.get_num_threads()} threads; quick={args.quick}\n")

    job, loop = {}, {}
    for name, comp in OPTIMIZERS:
        mem = recipe_run(comp, recipe_steps, tracked=True)
        timed = mem if args.quick else recipe_run(comp, recipe_steps, tracked=False)
        job[name] = {"peak": mem["peak"], "states": mem["states"], "train_s": timed["train_s"]}
        mem = loop_run(comp, 3, tracked=True)
        timed = mem if args.quick else loop_run(comp, loop_steps, tracked=False)
        loop[name] = {**timed, "peak": mem["peak"]}
        print(
            f"{name}: job peak {_mib(job[name]['peak'])} MiB, loop peak {_mib(mem['peak'])} MiB, "
            f"loop loss {timed['loss'][0]:.3f} -> {timed['loss'][1]:.3f}",
            flush=True,
        )
    print()
    print(
        table(f"Tiny CPU job (recipe, configs/tiny_cpu.yaml, {recipe_steps} steps)", job, "train_s")
    )
    print()
    params = loop[OPTIMIZERS[0][0]]["params"]
    print(table(f"Step loop, {params / 1e6:.1f}M-parameter decoder, batch 2x64", loop, "step_s"))


if __name__ == "__main__":
    main()
