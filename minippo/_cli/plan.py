"""``minippo plan``: the per-rank memory table of a config, computed without allocating the model."""

from __future__ import annotations

import argparse
import textwrap

from minippo.config import ConfigError, check_no_flags, load_config

DEFAULT_GPU_MEM_GIB = 80.0
# key=value arguments that are not config keys but inputs of the plan
PLAN_KEYS = ("gpu_mem_gib", "nproc_per_node", "device")

DESCRIPTION = textwrap.dedent(
    """\
    Print the per-rank memory plan of a run: parameters, gradients and optimizer states of the
    actor and critic, activations at the configured micro-batch and sequence length (with and
    without activation checkpointing), the reference model, the correction state (EWMA copy or
    old-actor snapshots), the engine's share of GPU memory; then whether it fits in gpu_mem_gib
    per GPU, the biggest items and the switches that would shrink them. Nothing is allocated: the
    model is built on the meta device. See docs/memory.md for every formula.

    gpu_mem_gib=N, nproc_per_node=N and device=cuda|cpu are plan inputs given like overrides
    (defaults: 80 GiB; the config's nproc_per_node key or 1 rank; the config's device key, else
    cuda for an SGLang engine and cpu otherwise); every other key=value overrides the config.
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
              minippo plan --config qwen3_4b_dapo_math_8gpu gpu_mem_gib=141 nproc_per_node=8
              minippo plan --config qwen3_4b_dapo_math_8gpu activation_checkpointing=false
            """
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value / ~key overrides; gpu_mem_gib=N, nproc_per_node=N, device=cuda|cpu",
    )
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Load the config, apply overrides, print the plan; exit code 0 when it fits (or on CPU),
    1 when it does not fit."""
    from minippo.training.memory_plan import plan_from_config

    overrides, extra = _split_plan_keys(list(args.overrides))
    check_no_flags(overrides)
    cfg = load_config(args.config, overrides)
    if "device" in extra:
        cfg.device = extra["device"]
    nproc = extra.get("nproc_per_node")
    gpu = extra.get("gpu_mem_gib")
    plan = plan_from_config(
        cfg,
        gpu_mem_gib=DEFAULT_GPU_MEM_GIB if gpu is None else gpu,
        world_size=None if nproc is None else int(nproc),
    )
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
