"""Memory of the behaviour-policy corrections, and the memory plan against measured peaks.

1. Measured: the recipe (``minippo run async_ppo --config tiny_cpu``) once per correction method,
   each in its own process; peak RSS of the trainer process tree from ``wait4``'s rusage
   (``ru_maxrss``), the bytes the correction reports holding (correction/snapshot_bytes,
   ewma_bytes, swap_buffer_bytes: largest over the steps), and the memory planner's correction
   item (``minippo.plan.plan_from_config`` on the same config) for the same model.
   ``--dim/--layers`` swap the tiny model for a wider one (``model._component_=ModelArgs``) so
   that the correction's bytes stand out of the RSS noise.
2. Planned: the per-rank correction memory of Qwen3-4B on 8 GPUs (FSDP2, fp32 master weights)
   per method and staleness, from the plan, against the reference figures of Guan et al.
   (exact snapshots ~40 GB host memory, PPO-EWMA ~7.9 GB, for a 4B model).
3. The plan against measured peaks (CPU): per case (tiny_cpu with one switch changed), the peak
   of live tensor bytes of the real recipe's trainer process from setup to the last step
   (``TensorMemoryTracker`` around ``setup`` + ``train``, in this process; the engine runs in its
   own), the formula's (``MemoryPlan.tensor_total``) and the measured plan's
   (``minippo.plan.measure_from_config``: one recipe step on fake tensors).

    python benchmarks/memory.py --quick                       # tiny model, 2 methods, seconds
    python benchmarks/memory.py --dim 256 --layers 8          # the figures in docs/benchmarks.md
    python benchmarks/memory.py --only-plan                   # section 3 only (docs/memory.md)
"""

from __future__ import annotations

import argparse
import math
import runpy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import (
    DEFAULT_OUT,
    QUIET_RUN,
    REPO,
    TINY_CPU_AS_MEASURED,
    TensorMemoryTracker,
    correction_bytes,
    load_average,
    machine,
    markdown_table,
    run_recipe,
)
from omegaconf import OmegaConf

from minippo.config import load_config
from minippo.plan import (
    GiB,
    PlanInputs,
    correction_cost,
    measure_from_config,
    model_param_shapes,
    plan_from_config,
    plan_memory,
)
from minippo.training.optimizers import optimizer_spec

MiB = 1 << 20
C = "minippo.rl.correction."
METHODS: dict[str, list[str]] = {
    "none (sync)": ["~correction"],
    "rollout_logprobs": ["~correction", f"+correction._component_={C}RolloutLogprobs"],
    "tis": ["~correction", f"+correction._component_={C}TIS"],
    "loglinear_prox": ["~correction", f"+correction._component_={C}LogLinearProx"],
    "ewma": ["~correction", f"+correction._component_={C}EWMA"],
    "keep_old_actor": ["~correction", f"+correction._component_={C}KeepOldActor"],
    "keep_old_actor bf16": [
        "~correction",
        f"+correction._component_={C}KeepOldActor",
        "+correction.storage_dtype=bf16",
    ],
}


def model_overrides(dim: int | None, layers: int | None) -> list[str]:
    """A wider Qwen3-style model for the tiny task (vocab 51 = TinyTokenizer), or nothing."""
    if dim is None:
        return []
    heads = max(4, dim // 64)
    return [
        "model._component_=minippo.models.ModelArgs",
        f"+model.dim={dim}",
        f"+model.n_layers={layers or 2}",
        f"+model.n_heads={heads}",
        f"+model.n_kv_heads={heads // 2}",
        f"+model.head_dim={dim // heads}",
        f"+model.intermediate_size={3 * dim}",
        "+model.tie_word_embeddings=true",
    ]


def measured(args) -> None:
    base = [
        f"total_steps={args.steps}",
        *TINY_CPU_AS_MEASURED,
        *model_overrides(args.dim, args.layers),
    ]
    if args.quick:
        base += ["rollout.groups_per_batch=8", "ppo.micro_batch_size=8"]
    methods = ["none (sync)", "ewma"] if args.quick else list(METHODS)

    def overrides(method: str) -> list[str]:
        s = 0 if method.startswith("none") else args.staleness
        return [*base, f"rollout.max_staleness={s}", *METHODS[method]]

    def one(method: str):
        d = args.out / method.replace(" ", "_").replace("(", "").replace(")", "")
        return method, run_recipe(overrides(method), d)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = dict(pool.map(one, methods))
    bad = {m: r for m, r in runs.items() if r.returncode != 0}
    if bad:
        raise SystemExit("\n".join(f"{m} failed:\n{r.log_tail}" for m, r in bad.items()))

    ref = runs.get("rollout_logprobs") or runs["none (sync)"]
    plans = {
        method: plan_from_config(
            load_config("tiny_cpu", [f"output_dir={run.out_dir}", *overrides(method)])
        )
        for method, run in runs.items()
    }
    numel = next(iter(plans.values())).items[0].device // 4  # actor parameters (fp32)
    rows = []
    for method, run in runs.items():
        held = correction_bytes(run)
        item = next(i for i in plans[method].items if i.name.startswith("correction"))
        planned = item.device + item.host
        rows.append(
            [
                method,
                0 if method.startswith("none") else args.staleness,
                f"{run.maxrss_mib:.0f}",
                f"{run.maxrss_mib - ref.maxrss_mib:+.0f}",
                f"{held / MiB:.2f}",
                f"{planned / MiB:.2f}",
                difference(method, planned - held, numel),
            ]
        )
    what = (
        f"tiny_cpu model ({numel:,} parameters)"
        if args.dim is None
        else (
            f"tiny_cpu task with a dim {args.dim}, {args.layers}-layer model ({numel:,} parameters, "
            f"{numel * 4 / MiB:.1f} MiB fp32)"
        )
    )
    print(f"{what}; {args.steps} steps per run, {args.jobs} run(s) in parallel")
    heads = [
        "method",
        "max_staleness",
        "peak RSS MiB",
        f"vs {'rollout_logprobs' if ref is runs.get('rollout_logprobs') else 'sync'} MiB",
        "held by the correction MiB (metrics)",
        "planner MiB",
        "planned − held",
    ]
    print(markdown_table(heads, rows))


def difference(method: str, diff: float, numel: int) -> str:
    """planned − held, in snapshot copies for keep_old_actor (the metric is read in ``prepare``,
    before the publish that adds the newest version; the planner counts that peak)."""
    if method.startswith("keep_old_actor"):
        per = numel * (2 if "bf16" in method else 4)
        return f"{diff / per:+.2f} snapshot"
    return f"{diff:+,.0f} B"


def planned_4b() -> None:
    """Correction memory per rank / per node of Qwen3-4B on 8 GPUs, from the memory planner."""
    from minippo.models import qwen3_4b

    args = qwen3_4b()
    adamw = optimizer_spec({"_component_": "torch.optim.AdamW"})
    rows = []
    cases = [("ewma", None, s) for s in (1, 4)] + [
        ("keep_old_actor", d, s) for d in (None, "bf16") for s in (1, 2, 4)
    ]
    classes = {"ewma": "EWMA", "keep_old_actor": "KeepOldActor"}
    for method, dtype, s in cases:
        node = {"_component_": C + classes[method]}
        if dtype is not None:
            node["storage_dtype"] = dtype
        x = PlanInputs(
            actor=args,
            critic=None,
            reference=False,
            world_size=8,
            device="cuda",
            master_bytes=4,
            compute_bytes=2,
            micro_batch=1,
            seq_len=10240,
            response_len=8192,
            activation_checkpointing=True,
            logits_chunk=1024,
            actor_optimizer=adamw,
            critic_optimizer=adamw,
            correction=correction_cost(
                OmegaConf.create(node), max_staleness=s, partial_rollout=False
            ),
            gpu_mem_bytes=80 * GiB,
        )
        item = next(i for i in plan_memory(x).items if i.name.startswith("correction"))
        store = (dtype or "fp32") if method == "keep_old_actor" else "fp32 θ̄"
        rows.append(
            [
                method,
                store,
                s,
                f"{item.device / GiB:.2f}",
                f"{item.host / GiB:.2f}",
                f"{8 * (item.device + item.host) / 1e9:.1f}",
                "~40 GB host" if method == "keep_old_actor" else "~7.9 GB",
            ]
        )
    n = sum(math.prod(s) for s in model_param_shapes(args))
    print(
        f"Qwen3-4B ({n / 1e9:.2f}B parameters), 8 ranks, FSDP2 fp32 master weights; planner "
        "correction item (snapshots in pinned host memory)"
    )
    heads = [
        "method",
        "stored as",
        "max_staleness",
        "per rank GPU GiB",
        "per rank host GiB",
        "per node GB",
        "Guan et al. (4B)",
    ]
    print(markdown_table(heads, rows))


# Section 3: tiny_cpu with one switch changed per case; "wider" swaps in a D = 256, 4-layer model.
WIDER = model_overrides(256, 4)
PLAN_CASES: dict[str, list[str]] = {
    "tiny_cpu": [],
    "activation_checkpointing": ["activation_checkpointing=true"],
    "AdamW8bit": [
        "optimizer._component_=torchao.optim.AdamW8bit",
        "critic.optimizer._component_=torchao.optim.AdamW8bit",
    ],
    "KeepOldActor": ["~correction", f"+correction._component_={C}KeepOldActor"],
    "grpo + TIS (no critic)": [
        "advantage_estimator=grpo",
        "~correction",
        f"+correction._component_={C}TIS",
    ],
    "score_micro_batch_size=16": ["ppo.score_micro_batch_size=16"],
    "max_new_tokens=48": ["rollout.max_new_tokens=48"],
    "max_new_tokens=48, AC": ["rollout.max_new_tokens=48", "activation_checkpointing=true"],
    "wider": WIDER,
    "wider, max_new_tokens=48, score_micro_batch_size=16": [
        *WIDER,
        "rollout.max_new_tokens=48",
        "ppo.score_micro_batch_size=16",
    ],
    "wider, max_new_tokens=48, AC, KeepOldActor": [
        *WIDER,
        "rollout.max_new_tokens=48",
        "activation_checkpointing=true",
        "~correction",
        f"+correction._component_={C}KeepOldActor",
    ],
}


def recipe_tensor_peak(overrides: list[str], out_dir: Path) -> int:
    """Peak live tensor bytes of the recipe's trainer (this process) from setup to the last
    step of ``tiny_cpu`` with ``overrides``; torchao's compiled steps run eagerly (compiling
    refuses to run under a dispatch mode)."""
    recipe = runpy.run_path(str(REPO / "recipes" / "async_ppo.py"), run_name="recipe")
    # the benchmark's own scratch folder: a rerun replaces the last run's outputs
    cfg = load_config(
        "tiny_cpu",
        [*QUIET_RUN, f"output_dir={out_dir}", "overwrite_output_dir=true", *overrides],
    )
    run = recipe["AsyncPPORecipe"](cfg)
    tracker = TensorMemoryTracker()
    try:
        with tracker, torch.compiler.set_stance("force_eager"):
            run.setup(cfg)
            run.train()
    finally:
        run.cleanup()
    return tracker.peak["cpu"]


def plan_vs_measured(args) -> list[list[str]]:
    """Section 3: the formula and the measured plan against the recipe's real peak, per case."""
    cases = {"tiny_cpu": []} if args.quick else PLAN_CASES
    rows = []
    for name, over in cases.items():
        over = [f"total_steps={args.plan_steps}", *TINY_CPU_AS_MEASURED, *over]
        real = recipe_tensor_peak(over, args.out / "plan" / name.replace(" ", "_"))
        cfg = load_config("tiny_cpu", over)
        formula = plan_from_config(cfg).tensor_total
        fake = measure_from_config(cfg)
        rows.append(
            [
                name,
                f"{real / 2**20:.2f}",
                f"{formula / 2**20:.2f}",
                f"{formula / real - 1:+.1%}",
                f"{fake.peak / 2**20:.2f}",
                f"{fake.peak / real - 1:+.1%}",
                f"{fake.seconds:.1f}",
            ]
        )
    heads = [
        "case",
        "recipe peak MiB",
        "formula MiB",
        "formula error",
        "fake-tensor step MiB",
        "fake-tensor error",
        "fake-tensor s",
    ]
    print(markdown_table(heads, rows))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 methods, 3 steps")
    p.add_argument("--dim", type=int, default=None, help="hidden size of a wider model")
    p.add_argument("--layers", type=int, default=None, help="layers of the wider model")
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--plan-steps", type=int, default=3, help="recipe steps per case in section 3")
    p.add_argument("--only-plan", action="store_true", help="section 3 only")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "memory")
    args = p.parse_args()
    if args.quick:
        args.dim = args.layers = None
        args.steps = 3
        args.out = args.out.with_name("memory_quick")
    print(f"machine: {machine()}")
    if not args.only_plan:
        print(f"\n## 1. measured per method (load average {load_average():.2f})")
        measured(args)
        print("\n## 2. planned: Qwen3-4B on 8 GPUs")
        planned_4b()
    print(f"\n## 3. the plan against measured peaks, CPU (load average {load_average():.2f})")
    plan_vs_measured(args)


if __name__ == "__main__":
    main()
