"""The ``minippo`` command: ls, cp, run, validate, plan."""

from __future__ import annotations

import argparse
import ast
import logging
import os
import runpy
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from minippo._cli import registry
from minippo._cli.plan import add_plan_parser
from minippo.config import ConfigError, check_no_flags, load_config, report_error, validate
from minippo.config._parse import PER_LAUNCH, RUN_TIME_ENV, new_launch
from minippo.config._report import debug, setup_logging

# a launch time given by the caller (every node of a multi-node run the same); else one per launch
_RUN_TIME_GIVEN = RUN_TIME_ENV in os.environ

EXAMPLES = textwrap.dedent(
    """\
    examples:
      minippo ls
      minippo run async_ppo --config tiny_cpu
      minippo run async_ppo --config tiny_cpu total_steps=40 correction.reset_below=0.7
      minippo run --nproc-per-node 8 async_ppo --config qwen3_4b_dapo_math_8gpu
      minippo cp tiny_cpu my_tiny.yaml
      minippo run async_ppo --config my_tiny.yaml
      minippo run eval --config tiny_eval_cpu
      minippo validate --config tiny_cpu
      minippo plan --config qwen3_4b_dapo_math_8gpu nproc_per_node=8 gpu_mem_gib=80
    """
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code.

    Errors end in one ``minippo: error:`` line (exit code 2 for bad input, 1 otherwise);
    ``MINIPPO_LOG_LEVEL=DEBUG`` also prints the traceback."""
    setup_logging()
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
    except BrokenPipeError:  # `minippo run --help | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        return 0
    return code


def _main(argv: list[str]) -> int:
    parser = _build_parser()
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
    except BrokenPipeError:
        raise
    except (Exception, KeyboardInterrupt) as e:
        return report_error(e)


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
        help="run every check `minippo run` runs before it builds anything",
        description=(
            "Load a config, apply overrides, resolve ${...}; then run the checks `minippo run` "
            "runs before it builds or writes anything: the recipe's validate_config (every key "
            "the recipe reads, with its type and range, and misspelled keys of the YAML file as "
            "of the command line; every _component_ imported and bound to its signature; the "
            "off-policy correction contract; the batch shapes for the number of ranks) and the "
            "input files (checkpoint_path, dataset files and their prompt and answer fields, the "
            "checkpoint to resume) and output_dir (not a file, writable, not in use by a live "
            "run, no other run's outputs unless resumed or overwritten), and the launcher's "
            "--nproc-per-node and --nnodes. Prints every problem, one line each; exit code 1 when "
            "there are problems."
        ),
        epilog=textwrap.dedent(
            """\
            examples:
              minippo validate --config tiny_cpu
              minippo validate --config my_tiny.yaml rollout.max_staleness=4
              minippo validate --config qwen3_0_6b_gsm8k_1gpu --nproc-per-node 1
              minippo validate --recipe my_ppo.py --config my.yaml
            """
        ),
        formatter_class=fmt,
    )
    p.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    p.add_argument(
        "--recipe",
        help="built-in recipe name or .py file whose checks to run (default: the recipe of a "
        "built-in config, else eval for a config with a top-level samples_per_prompt or "
        "samples_path, else async_ppo for one with a rollout section or 3 of its other "
        "top-level keys, else the _component_ checks only)",
    )
    p.add_argument(
        "--nproc-per-node",
        help="ranks per node, as given to `minippo run --nproc-per-node` (default: the launch a "
        "built-in config is written for, else one plain process)",
    )
    p.add_argument(
        "--nnodes", default="1", help="nodes, as given to `minippo run --nnodes` (default: 1)"
    )
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
    one process per rank; without launcher flags the recipe runs in this process. Before any rank
    starts, this launcher runs every check of `minippo validate` (on each node: files may differ).

    launcher flags (torchrun's, forwarded unchanged; `torchrun --help` lists every one):
      --nproc-per-node N         ranks on this node (one per GPU)
      --nnodes N                 nodes of the run (MIN:MAX: elastic; minippo needs a fixed N)
      --node-rank R              this node's index, 0 .. nnodes-1 (static rendezvous)
      --master-addr HOST         address of node 0, the same on every node (static rendezvous)
      --master-port PORT         port on node 0, the same on every node (0: any free port, one node)
      --rdzv-backend c10d        rendezvous through a store on --rdzv-endpoint (ranks in order
                                 of arrival) instead of node 0's address (static, the default)
      --rdzv-endpoint HOST:PORT  where the c10d store listens (one node's address)
      --rdzv-id ID               a name every node of this run shares (c10d)
      --max-restarts N           restart every node's ranks up to N times after a failure (they
                                 start from the config again: set resume_from=latest)
    Several nodes: parallel.sharding=hsdp, and parallel.shared_output_dir says whether output_dir
    is one folder all nodes see (docs/multinode.md).

    examples:
      minippo run async_ppo --config tiny_cpu
      minippo run async_ppo --config tiny_cpu total_steps=10 seed=1 correction.reset_below=0.7
      minippo run --nproc-per-node 2 async_ppo --config tiny_cpu
      minippo run ./my_recipe.py --config ./my_tiny.yaml ~eval
      minippo run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
          --nproc-per-node 8 async_ppo --config my_16gpu.yaml parallel.sharding=hsdp \\
          output_dir=/shared/runs/run1

    output_dir: the built-in configs write each launch to a new folder named by its time
    (/tmp/minippo/<config>/<YYYYmmdd-HHMMSS>); after a run ends well, <config>/latest points at
    it. An output_dir you set is used as it is: one run per folder (resume_from or
    overwrite_output_dir=true to reuse it).
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
    text = src.read_text(encoding="utf-8")
    if src.suffix == ".yaml":  # the copy writes its runs to its own folder, not the original's
        text = _own_output_dir(text, dest.stem)
    dest.write_text(text, encoding="utf-8")
    print(f"Copied {name} to {dest}")
    return 0


def _own_output_dir(text: str, name: str) -> str:
    """A built-in config's text with its top-level ``output_dir: /tmp/minippo/<config>...``
    moved to ``/tmp/minippo/<name>...`` (the rest of the value and the comment kept)."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("output_dir: /tmp/minippo/"):
            head, _, rest = line.partition("/tmp/minippo/")
            rest = rest[len(rest.split("/")[0].split()[0]) :] if rest.strip() else rest
            lines[i] = f"{head}/tmp/minippo/{name}{rest}"
            break
    return "".join(lines)


def _validate(args: argparse.Namespace) -> int:
    _add_cwd_to_path()
    if not _RUN_TIME_GIVEN:
        new_launch()
    try:
        nproc = args.nproc_per_node
        if nproc is None and registry.config_entry(args.config) is not None:
            nproc = registry.config_entry(args.config)[1].nproc_per_node
        world, per_node = launch_size(nproc or 1, args.nnodes)
        cfg = load_config(_config_path(args.config), args.overrides)  # as `run` loads it
        recipe = _recipe_of(args.recipe, args.config, cfg)
        problems = preflight_problems(
            cfg,
            recipe,
            world_size=world,
            distributed=nproc is not None or world > 1,
            local_world_size=per_node,
        )
    except ConfigError as e:
        problems = e.problems
    if problems:
        _print_problems(problems)
        return 1
    print("Config is well-formed!")
    return 0


def launch_size(nproc_per_node: str | int, nnodes: str | int = 1) -> tuple[int, int]:
    """(ranks in all, ranks per node) of a launch with torchrun's ``--nproc-per-node`` and
    ``--nnodes``; a ConfigError for what minippo cannot run (0 ranks, an elastic node count)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        per_node = determine_local_world_size(str(nproc_per_node))
    except ValueError as e:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node}: {e}; give the ranks per node, an integer >= 1"
        ) from None
    if per_node < 1:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node}: a run needs at least 1 rank per node; give "
            "--nproc-per-node 1 or more (one per GPU)"
        )
    try:
        low, high = parse_min_max_nnodes(str(nnodes))
    except (ValueError, RuntimeError) as e:
        raise ConfigError(
            f"--nnodes {nnodes}: {e}; give the number of nodes, e.g. --nnodes 2"
        ) from None
    if low != high:
        raise ConfigError(
            f"--nnodes {nnodes}: minippo needs a fixed number of nodes (the batch is split "
            "over the ranks, and a checkpoint keeps per-rank state); give --nnodes N"
        )
    if high < 1:
        raise ConfigError(
            f"--nnodes {nnodes}: a run needs at least 1 node; give --nnodes 1 or more"
        )
    return per_node * high, per_node


def preflight_problems(
    cfg,
    recipe_path: Path | None,
    *,
    world_size: int,
    distributed: bool,
    local_world_size: int | None = None,
) -> list[str]:
    """Every check `minippo run` makes before its first expensive step, and `minippo validate`
    with it: :func:`run_checks` (the recipe's config checks, the input files, output_dir's
    state), and output_dir named by the launch time on several nodes."""
    problems = run_checks(
        cfg,
        recipe_path,
        world_size=world_size,
        distributed=distributed,
        local_world_size=local_world_size,
    )
    per_node = local_world_size or world_size
    if (
        world_size > per_node
        and "output_dir" in getattr(cfg, PER_LAUNCH, ())
        and not _RUN_TIME_GIVEN
    ):
        problems.append(
            f"output_dir={cfg.output_dir} is named by the launch time (${{now:...}}), which each "
            "node would read from its own clock; give every node the same output_dir (e.g. "
            "output_dir=/shared/runs/run1)"
        )
    return problems


def _recipe_of(recipe: str | None, config: str, cfg) -> Path | None:
    """The recipe file whose checks apply to a config (see `minippo validate --help`)."""
    if recipe is not None:
        return _recipe_path(recipe)
    entry = registry.config_entry(config)
    if entry is not None:
        return registry.builtin_recipe_path(entry[0].name)
    from minippo.training.preflight import ASYNC_PPO_SCHEMA

    eval_keys = ("samples_per_prompt", "samples_path")  # either, should the other be misspelled
    if "rollout" not in cfg and any(k in cfg for k in eval_keys):
        return registry.builtin_recipe_path("eval")
    # an async PPO config, also with a misspelled section (`rollouts:`), which its schema names
    if "rollout" in cfg or len(set(cfg) & set(ASYNC_PPO_SCHEMA)) >= 3:
        return registry.builtin_recipe_path("async_ppo")
    return None


def recipe_checks(recipe_path: Path) -> Callable | None:
    """The ``validate_config(cfg, world_size, distributed)`` a recipe file defines (None when it
    defines none). The file is run under another name than ``__main__``, so its main block does
    not run; a recipe that defines ``validate_config`` must keep its other top-level code cheap."""
    tree = ast.parse(recipe_path.read_text(encoding="utf-8"), str(recipe_path))
    if not any(isinstance(n, ast.FunctionDef) and n.name == "validate_config" for n in tree.body):
        return None
    return runpy.run_path(str(recipe_path), run_name="__minippo_checks__")["validate_config"]


def run_checks(
    cfg,
    recipe_path: Path | None,
    *,
    world_size: int,
    distributed: bool,
    local_world_size: int | None = None,
) -> list[str]:
    """Every problem `minippo run` would refuse ``cfg`` for before building anything: the
    recipe's ``validate_config`` (or, for a recipe without one, the ``_component_`` checks), then
    the input files (``minippo.training.preflight``; ``local_world_size``: ranks per node, for
    the layout of a checkpoint to resume); one line each."""
    from minippo.training.preflight import input_problems

    check = recipe_checks(recipe_path) if recipe_path is not None else None
    problems: list[str] = []
    if check is None:
        problems = validate(cfg)
    else:
        try:
            check(cfg, world_size, distributed)
        except ConfigError as e:
            problems = list(e.problems)
        except ValueError as e:
            problems = [str(e)]
    if not problems:  # as in a run: the files once the config is right
        problems = input_problems(cfg, world_size, local_world_size)
    return problems


def _print_problems(problems: list[str]) -> None:
    from minippo.config._report import error_lines

    print(f"minippo: config has {len(problems)} problem(s):", file=sys.stderr)
    for p in problems:  # one line each, in the words of `minippo run`'s error lines
        print(f"  - {error_lines(ConfigError(p))[0]}", file=sys.stderr)


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_RUN_HELP)
        return 0 if argv else 2
    from torch.distributed.run import get_args_parser

    launcher = get_args_parser()
    _check_recipe_first(argv, launcher)
    launcher.prog = "minippo run"
    launcher.error = _launcher_error  # one line, not torchrun's usage
    largs = launcher.parse_args(argv)
    # any launcher flag before the recipe launches torchrun, also one equal to torchrun's default
    # (`--nproc-per-node 1`: a one-rank process group, which bf16 FSDP2 needs)
    distributed = len(argv) - len(largs.training_script_args) - 1 > 0

    recipe_path = _recipe_path(largs.training_script)
    rest = list(largs.training_script_args)
    config, overrides = _split_config(rest)
    cfg_path = _config_path(config)
    world_size, per_node = (
        launch_size(largs.nproc_per_node, largs.nnodes) if distributed else (1, 1)
    )
    if not _RUN_TIME_GIVEN:
        new_launch()  # ${now:...}: this launch's time, here and in the ranks started from here
    # Fail fast in the launcher, before any process is started: the config must load.
    cfg = load_config(cfg_path, overrides)
    _add_cwd_to_path()  # modules of the current folder (a user's reward) import, as in Python

    # every check the recipe (each rank) runs first, once here (on each node: its files may
    # differ), before any rank or model exists; `minippo validate` runs the same
    problems = preflight_problems(
        cfg, recipe_path, world_size=world_size, distributed=distributed, local_world_size=per_node
    )
    if problems:
        raise ConfigError("\n".join(problems), problems)
    from minippo.training.preflight import LAUNCHER_CHECKED_ENV

    script_args = ["--config", str(cfg_path), *overrides]
    if distributed:
        largs.training_script = str(recipe_path)
        largs.training_script_args = script_args
        if largs.master_port == 0:  # "any free port": the ranks must all be told the same one
            if world_size != per_node and largs.rdzv_backend == "static":
                raise ConfigError(
                    "--master-port 0 picks a free port on this node, which the other nodes "
                    "cannot know; give every node the same --master-port (e.g. 29500)"
                )
            largs.master_port = _free_port()
        # the ranks repeat these checks; their warnings were printed here, once per node
        os.environ[LAUNCHER_CHECKED_ENV] = "1"
        code = _launch(largs)
    else:
        code = _run_here(recipe_path, script_args, LAUNCHER_CHECKED_ENV)
    if code == 0 and "output_dir" in getattr(cfg, PER_LAUNCH, ()):
        from minippo.training.output_dir import link_latest

        link_latest(cfg.output_dir)  # <config folder>/latest: this run, which ended well
    return code


def _run_here(recipe_path: Path, script_args: list[str], checked_env: str) -> int:
    """The recipe in this process, as `python recipe.py <script_args>`; its exit code."""
    old_argv, old_checked = sys.argv, os.environ.get(checked_env)
    sys.argv = [str(recipe_path), *script_args]
    os.environ[checked_env] = "1"  # the recipe repeats the checks; their warnings were printed
    try:
        runpy.run_path(str(recipe_path), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        if old_checked is None:
            os.environ.pop(checked_env, None)
        else:
            os.environ[checked_env] = old_checked
    return 0


def _check_recipe_first(argv: list[str], launcher: argparse.ArgumentParser) -> None:
    """Refuse `run --config X recipe`: only launcher flags go before the recipe."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            value = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[9:]
            after = [a for a in argv[i + 2 :] if not a.startswith("-") and "=" not in a]
            recipe = after[0] if after else "<recipe>"
            raise ConfigError(
                f"--config comes after the recipe: minippo run {recipe} --config {value} "
                "[key=value ...] (only launcher flags such as --nproc-per-node go before the "
                "recipe)"
            )
        if not arg.startswith("-"):
            return  # the recipe
        action = launcher._option_string_actions.get(arg)
        takes_value = "=" not in arg and action is not None and action.nargs != 0
        i += 2 if takes_value else 1


def _launcher_error(message: str) -> None:
    raise ConfigError(
        f"{message} (minippo run [launcher flags] <recipe> --config <config> [key=value ...]; "
        "launcher flags: minippo run --help)"
    )


def _recipe_path(recipe: str) -> Path:
    if recipe.endswith(".py"):
        path = Path(recipe).expanduser()
        if not path.is_file():
            raise ConfigError(f"recipe file {recipe!r} does not exist")
        return path
    return registry.builtin_recipe_path(recipe)


def _add_cwd_to_path() -> None:
    """Make modules in the current folder importable here and in ranks started from here (the
    console script's sys.path does not hold the current folder, `python -m` does)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *parts])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(largs: argparse.Namespace) -> int:
    """torchrun in this process; a failed rank or a signal ends in one line, not torchrun's
    report (each rank printed its own error)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    if not debug():  # torchrun's own notices (OMP_NUM_THREADS, "sending signal ...")
        names = list(logging.root.manager.loggerDict)
        for name in [*names, "torch.distributed.run", "torch.distributed.elastic"]:
            if name.startswith(("torch.distributed.run", "torch.distributed.elastic")):
                logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(largs)
    except SignalException as e:  # the ranks got the signal too and stopped at a step's end
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        code = failure.exitcode
        if code < 0:
            print(
                f"minippo: error: rank {rank} was killed by signal {failure.signal_name()}; "
                "the other ranks were stopped",
                file=sys.stderr,
            )
            return 128 - code
        return code
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
