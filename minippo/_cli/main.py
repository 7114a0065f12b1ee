"""The ``minippo`` command: ls, cp, run, validate, plan."""

from __future__ import annotations

import argparse
import runpy
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from minippo._cli import registry
from minippo._cli.plan import add_plan_parser
from minippo.config import ConfigError, check_no_flags, load_config, validate

EXAMPLES = textwrap.dedent(
    """\
    examples:
      minippo ls
      minippo run async_ppo --config tiny_cpu
      minippo run async_ppo --config tiny_cpu total_steps=40 correction.reset_below=0.7
      minippo run --nproc-per-node 8 async_ppo --config qwen3_4b_dapo_math_8gpu
      minippo cp tiny_cpu my_tiny.yaml
      minippo run async_ppo --config my_tiny.yaml
      minippo validate --config tiny_cpu
      minippo plan --config qwen3_4b_dapo_math_8gpu nproc_per_node=8 gpu_mem_gib=80
    """
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # `run` hands everything after the recipe to the recipe, so it is parsed separately.
        return _guard(_run, argv[1:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _guard(args.func, args)


def _guard(func, args) -> int:
    try:
        return func(args) or 0
    except ConfigError as e:
        print(f"minippo: error: {e}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="minippo",
        description="Asynchronous PPO for LLMs on one node: recipes, configs and tools.",
        epilog=EXAMPLES,
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", metavar="{ls,cp,run,validate,plan}")

    p = sub.add_parser(
        "ls",
        help="list built-in recipes and their configs",
        description="List built-in recipes and their configs.",
        epilog="example:\n  minippo ls",
        formatter_class=fmt,
    )
    p.set_defaults(func=_ls)

    p = sub.add_parser(
        "cp",
        help="copy a built-in recipe or config for editing",
        description=(
            "Copy a built-in recipe or config to a local file so that you can edit it and run it "
            "with `minippo run <file.py> --config <file.yaml>`.\n\n"
            "An existing destination is never overwritten unless --force is given; with "
            "--no-clobber an existing destination is left as it is and the command succeeds "
            "without copying (handy in scripts). A destination without a suffix gets .py or "
            ".yaml; a destination that is a folder receives the file under its built-in name."
        ),
        epilog=textwrap.dedent(
            """\
            examples:
              minippo cp async_ppo my_recipe.py
              minippo cp tiny_cpu configs/          # -> configs/tiny_cpu.yaml
              minippo cp tiny_cpu my_tiny.yaml --force
            """
        ),
        formatter_class=fmt,
    )
    p.add_argument("name", help="built-in recipe or config name (see `minippo ls`)")
    p.add_argument("destination", type=Path, help="file or existing folder to copy to")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--force", action="store_true", help="overwrite an existing destination")
    group.add_argument(
        "-n", "--no-clobber", action="store_true", help="leave an existing destination and exit 0"
    )
    p.set_defaults(func=_cp)

    # `run` is parsed by _run (it forwards launcher flags to torchrun); this entry is for --help.
    sub.add_parser(
        "run",
        help="run a recipe with a config (through torchrun when launcher flags are given)",
        description=_RUN_HELP,
        formatter_class=fmt,
        add_help=False,
    )

    p = sub.add_parser(
        "validate",
        help="check a config: YAML, overrides, interpolations and every _component_",
        description=(
            "Load a config, apply overrides, resolve ${...}, import every _component_ and bind its "
            "keys to the real signature; for async_ppo configs also run the off-policy correction "
            "check. Prints each problem with its key path; exit code 1 when there are problems."
        ),
        epilog=textwrap.dedent(
            """\
            examples:
              minippo validate --config tiny_cpu
              minippo validate --config my_tiny.yaml rollout.max_staleness=4
            """
        ),
        formatter_class=fmt,
    )
    p.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    p.add_argument("overrides", nargs="*", help="key=value, +key=value or ~key")
    p.set_defaults(func=_validate)

    add_plan_parser(sub)
    return parser


_RUN_HELP = textwrap.dedent(
    """\
    usage: minippo run [torchrun flags] <recipe|path.py> --config <name|path.yaml> [key=value ...] [~key ...]

    Run a built-in recipe (see `minippo ls`) or a local recipe file with a built-in config or a
    local YAML. Arguments after --config override config values: key=value sets an existing key,
    +key=value adds one, ~key deletes one. Any torchrun flag before the recipe (for example
    --nproc-per-node 8, --nnodes, --rdzv-endpoint) launches the recipe through torch.distributed.run,
    one process per rank; without launcher flags the recipe runs in this process.

    examples:
      minippo run async_ppo --config tiny_cpu
      minippo run async_ppo --config tiny_cpu total_steps=10 seed=1 correction.beta=0.5
      minippo run --nproc-per-node 2 async_ppo --config tiny_cpu
      minippo run ./my_recipe.py --config ./my_tiny.yaml ~logger.log_dir
    """
)


def _ls(args: argparse.Namespace) -> int:
    rows = [("RECIPE", "CONFIG")]
    for recipe in registry.RECIPES:
        names = [c.name for c in recipe.configs] or ["-"]
        rows.append((recipe.name, names[0]))
        rows.extend(("", n) for n in names[1:])
    width = max(len(r[0]) for r in rows) + 3
    for recipe_name, config_name in rows:
        print(f"{recipe_name:<{width}}{config_name}")
    return 0


def _cp(args: argparse.Namespace) -> int:
    name = args.name
    if registry.get_recipe(name) is not None:
        src = registry.builtin_recipe_path(name)
    elif name in registry.config_names():
        src = registry.builtin_config_path(name)
    else:
        known = registry.recipe_names() + registry.config_names()
        raise ConfigError(f"unknown recipe or config {name!r}; built-in names: {', '.join(known)}")
    dest: Path = args.destination
    if dest.is_dir():
        dest = dest / src.name
    elif not dest.suffix:
        dest = dest.with_suffix(src.suffix)
    if not dest.parent.exists():
        raise ConfigError(
            f"folder {str(dest.parent)!r} does not exist; create it first (mkdir -p {dest.parent})"
        )
    if dest.exists():
        if args.no_clobber:
            print(f"{dest} exists; left unchanged (--no-clobber)")
            return 0
        if not args.force:
            raise ConfigError(f"{str(dest)!r} already exists; pass --force to overwrite it")
    shutil.copyfile(src, dest)
    print(f"Copied {name} to {dest}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        _print_problems(e.problems)
        return 1
    problems = validate(cfg)
    if "rollout" in cfg:  # an async_ppo config: run the fail-fast correction check too
        from minippo.rl.correction import validate_async_off_policy_correction

        try:
            validate_async_off_policy_correction(cfg)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        _print_problems(problems)
        return 1
    print("Config is well-formed!")
    return 0


def _print_problems(problems: list[str]) -> None:
    print(f"minippo: config has {len(problems)} problem(s):", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_RUN_HELP)
        return 0 if argv else 2
    from torch.distributed.run import get_args_parser, run

    launcher = get_args_parser()
    launcher.prog = "minippo run"
    try:
        largs = launcher.parse_args(argv)
    except SystemExit as e:  # argparse already printed the problem
        return int(e.code or 2)
    defaults = vars(get_args_parser().parse_args(["x"]))
    distributed = any(
        v != defaults[k]
        for k, v in vars(largs).items()
        if k not in ("training_script", "training_script_args")
    )

    recipe = largs.training_script
    if recipe.endswith(".py"):
        recipe_path = Path(recipe)
        if not recipe_path.is_file():
            raise ConfigError(f"recipe file {recipe!r} does not exist")
    else:
        recipe_path = registry.builtin_recipe_path(recipe)

    rest = list(largs.training_script_args)
    config, overrides = _split_config(rest)
    cfg_path = _config_path(config)
    # Fail fast in the launcher, before any process is started: the config must load.
    load_config(cfg_path, overrides)

    script_args = ["--config", str(cfg_path), *overrides]
    if distributed:
        largs.training_script = str(recipe_path)
        largs.training_script_args = script_args
        run(largs)
        return 0
    old_argv = sys.argv
    sys.argv = [str(recipe_path), *script_args]
    try:
        runpy.run_path(str(recipe_path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
    return 0


def _split_config(args: list[str]) -> tuple[str, list[str]]:
    config, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise ConfigError("--config needs a value: a built-in config name or a YAML path")
            config, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    check_no_flags(rest)
    if config is None:
        raise ConfigError(
            "missing --config; for example: minippo run async_ppo --config tiny_cpu "
            f"(built-in configs: {', '.join(registry.config_names())})"
        )
    return config, rest


def _config_path(config: str) -> Path:
    from minippo.config import resolve_config_path

    return resolve_config_path(config).resolve()


if __name__ == "__main__":
    sys.exit(main())
