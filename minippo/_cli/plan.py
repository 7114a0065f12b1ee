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
    without activation checkpointing), the reference model, the weights the correction stores,
    the engine's share of GPU memory; then whether it fits in gpu_mem_gib per GPU, the biggest
    items and the switches that would shrink them. Nothing is allocated: the model is built on
    the meta device. See docs/memory.md for every formula.

    --measure also runs one recipe step of the configured models on fake tensors
    (FakeTensorMode: real shapes, no data) and prints its peak of live tensor bytes next to the
    formula's (seconds for small models, a minute or more for billions of parameters).

    gpu_mem_gib=N, nproc_per_node=N and device=cuda|cpu are plan inputs given like overrides
    (defaults: 80 GiB; 1 rank; cuda when the engine class reserves a share of GPU memory, as
    SGLang's mem_fraction_static does, else cpu); every other key=value overrides the config.
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
              minippo plan --config tiny_cpu --measure
              minippo plan --config qwen3_4b_dapo_math_8gpu gpu_mem_gib=141 nproc_per_node=8 \\
                  checkpoint_path=null 'model={_component_: minippo.models.qwen3_4b}'
              minippo plan --config qwen3_4b_dapo_math_8gpu activation_checkpointing=false ...
            """
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run one recipe step on fake tensors and print its measured peak",
    )
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
    from minippo.plan import plan_from_config

    overrides, extra = _split_plan_keys(list(args.overrides))
    check_no_flags(overrides)
    cfg = load_config(args.config, overrides)
    kw = {
        "gpu_mem_gib": float(extra.get("gpu_mem_gib", DEFAULT_GPU_MEM_GIB)),
        "world_size": int(extra.get("nproc_per_node", 1)),
        "device": extra.get("device"),
    }
    plan = plan_from_config(cfg, **kw)
    print(plan.table())
    if getattr(args, "measure", False):
        from minippo.plan import measure_from_config

        print()
        print(measured_lines(plan, measure_from_config(cfg, **kw)))
    return 0 if plan.fits in (True, None) else 1


def measured_lines(plan, measured) -> str:
    """The measured peak next to the formula's live tensor bytes (device and host together)."""
    unit, div = ("GiB", 2**30) if measured.peak >= 2**30 else ("MiB", 2**20)
    formula = plan.tensor_total
    kinds = ", ".join(
        f"{k.lower()} {v / div:.2f}" for k, v in measured.by_kind.items() if v and k != "Buffer"
    )
    return "\n".join(
        [
            f"measured: one recipe step on fake tensors ({measured.device} kernels, "
            f"{measured.seconds:.0f} s): peak {measured.peak / div:.2f} {unit} of live tensors, "
            f"device and host together",
            f"formula:  {formula / div:.2f} {unit} for the same ({formula / measured.peak - 1:+.1%})",
            f"at the measured peak ({unit}): {kinds}",
        ]
    )


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
