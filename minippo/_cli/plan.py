"""``minippo plan``: the per-rank memory table of a config, computed without allocating the model."""

from __future__ import annotations

import argparse
import textwrap

from minippo.config import ConfigError, check_no_flags, load_config

DEFAULT_GPU_MEM_GIB = 80.0
# key=value arguments that are not config keys but inputs of the plan
PLAN_KEYS = ("gpu_mem_gib", "nproc_per_node", "nnodes", "device")

DESCRIPTION = textwrap.dedent(
    """\
    Print the per-rank memory plan of a run: parameters, gradients and optimizer states of the
    actor and critic, activations at the configured micro-batch and sequence length (with and
    without activation checkpointing), the reference model, the weights the correction stores,
    the engine's share of GPU memory; then whether it fits in gpu_mem_gib per GPU, the biggest
    items and the switches that would shrink them. Nothing is allocated.

    The totals and the verdict come from one recipe step of the configured models run on fake
    tensors (FakeTensorMode: real shapes, no data; seconds for small models, about a minute for
    billions of parameters), which was closer to measured peaks than the formulas on every CPU
    case of docs/memory.md; the items come from the formulas. --formula-only skips the step.

    gpu_mem_gib=N, nproc_per_node=N, nnodes=N and device=cuda|cpu are plan inputs given like
    overrides (defaults: 80 GiB; 1 rank; 1 node; cuda when the engine class reserves a share of
    GPU memory, as SGLang's mem_fraction_static does, else cpu); every other key=value overrides
    the config. With nnodes > 1 the plan also prints the bytes one training step sends across
    nodes under parallel.sharding=fsdp and hsdp (docs/multinode.md).
    """
)


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on the CLI's subparsers; returns the new parser."""
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory plan of a config: does it fit, and what would shrink it",
        description=DESCRIPTION,
        epilog=textwrap.dedent(
            """\
            examples:
              minippo plan --config tiny_cpu
              minippo plan --config qwen3_4b_dapo_math_8gpu gpu_mem_gib=141 nproc_per_node=8 \\
                  checkpoint_path=null 'model={_component_: minippo.models.qwen3_4b}'
              minippo plan --formula-only --config tiny_cpu activation_checkpointing=true
              minippo plan --config qwen3_4b_dapo_math_8gpu nnodes=2 nproc_per_node=8 \\
                  parallel.sharding=hsdp
            """
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    p.add_argument(
        "--formula-only",
        action="store_true",
        help="skip the measured step: totals and verdict from the formulas (instant)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value / ~key overrides; gpu_mem_gib=N, nproc_per_node=N, nnodes=N, "
        "device=cuda|cpu",
    )
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Load the config, apply overrides, print the plan; exit code 0 when it fits (or on CPU),
    1 when it does not fit."""
    from minippo.plan import plan_from_config

    overrides, extra = _split_plan_keys(list(args.overrides))
    check_no_flags(overrides)
    cfg = load_config(args.config, overrides)
    kw = {
        "gpu_mem_gib": float(extra.get("gpu_mem_gib", DEFAULT_GPU_MEM_GIB)),
        "world_size": int(extra.get("nproc_per_node", 1)),
        "device": extra.get("device"),
        "nnodes": int(extra.get("nnodes", 1)),
    }
    plan = plan_from_config(cfg, **kw)
    if not getattr(args, "formula_only", False):
        from minippo.plan import measure_from_config

        plan.measured = measure_from_config(cfg, **kw)
    print(plan.table())
    return 0 if plan.fits in (True, None) else 1


def _split_plan_keys(items: list[str]) -> tuple[list[str], dict[str, object]]:
    overrides, extra = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+") == "device":
            if value not in ("cuda", "cpu"):
                raise ConfigError(f"device={value!r} must be cuda or cpu")
            extra["device"] = value
        elif sep and key.lstrip("+") in PLAN_KEYS:
            try:
                extra[key.lstrip("+")] = float(value)
            except ValueError as e:
                raise ConfigError(f"{key}={value!r} must be a number, e.g. {key}=141") from e
            if extra[key.lstrip("+")] <= 0:
                raise ConfigError(f"{key}={value} must be positive")
        else:
            overrides.append(item)
    return overrides, extra
