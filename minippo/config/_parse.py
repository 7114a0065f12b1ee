"""Loading YAML configs and applying command-line overrides.

Override syntax (the same for ``minippo run``, ``minippo validate`` and a recipe run as a script):

    a.b=value    set an existing key (the value is parsed as YAML: 3, 0.5, true, null, [1, 2], abc)
    +a.b=value   add a key that the config does not have yet
    ~a.b         delete a key

Setting a key that does not exist is an error (it is almost always a typo); the message suggests the
closest existing keys and says how to add a new one on purpose. (Keys of the YAML file itself are
checked by the recipe's schema, ``minippo.config.schema``.)

A value that starts with ``~/`` (or is ``~``) is a path in the home folder: it is expanded before
``${...}`` are resolved, so ``output_dir=~/runs/x`` also moves ``${output_dir}/checkpoints``.

``${now:FORMAT}`` is the launch time in ``time.strftime``'s FORMAT (``${now:%Y%m%d-%H%M%S}``); one
launch resolves it to one value, in the launcher and in every rank it starts (``MINIPPO_RUN_TIME``,
seconds since the epoch, carries it to them). The built-in configs name their ``output_dir`` so.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from minippo.config._errors import ConfigError
from minippo.config._instantiate import _join

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_MISSING = object()
RUN_TIME_ENV = "MINIPPO_RUN_TIME"  # the launch time ${now:...} formats (seconds since the epoch)


def new_launch() -> None:
    """Start a new launch: the next ``${now:...}`` resolved in this process (and in the processes
    it starts) reads the time of this call."""
    os.environ[RUN_TIME_ENV] = str(int(time.time()))


def _now(fmt: str = "%Y%m%d-%H%M%S") -> str:
    if RUN_TIME_ENV not in os.environ:
        new_launch()
    return time.strftime(fmt, time.localtime(int(os.environ[RUN_TIME_ENV])))


if not OmegaConf.has_resolver("now"):  # register_resolver: omegaconf >= 2.4
    getattr(OmegaConf, "register_resolver", OmegaConf.register_new_resolver)("now", _now)


def resolve_config_path(config: str | Path) -> Path:
    """A built-in config name (``tiny_cpu``) or a path to a YAML file -> the file's path."""
    path = Path(config).expanduser()
    if path.is_dir():
        raise ConfigError(
            f"--config {str(config)!r} is a folder; give a YAML file or a built-in config name"
        )
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            from minippo._cli.registry import config_names

            hint = ""
            if path.stem in config_names() and len(path.parts) == 1:
                hint = f"; for the built-in config give its name: --config {path.stem}"
            raise ConfigError(f"config file {str(config)!r} does not exist{hint}")
        return path
    from minippo._cli.registry import builtin_config_path

    return builtin_config_path(str(config))


def load_config(config: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load a config by built-in name or path, apply ``overrides``, resolve ``${...}``.

    Raises ConfigError naming the key path and the value for: unreadable YAML, a config that is not a
    mapping, bad override syntax, unknown keys, broken interpolations and required values (``???``)
    left unset.
    """
    path = resolve_config_path(config)
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors carry line/column in their text
        msg = " ".join(str(e).split())
        raise ConfigError(f"cannot parse config {str(path)!r}: {msg}") from e
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config {str(path)!r} must be a YAML mapping at top level, got a list")
    if len(cfg) == 0:
        raise ConfigError(
            f"config file {str(path)!r} is empty (no keys); start from a built-in config: "
            f"minippo cp tiny_cpu {path}"
        )
    apply_overrides(cfg, overrides)
    expand_home(cfg)
    resolve(cfg)
    return cfg


def expand_home(node: DictConfig | ListConfig) -> None:
    """Expand ``~/...`` (and ``~``) in every string value, in place; interpolations untouched."""
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for key, _ in list(items):
        child = node._get_node(key)
        if isinstance(child, DictConfig | ListConfig):
            expand_home(child)
            continue
        value = child._value() if child is not None else None
        if isinstance(value, str) and (value == "~" or value.startswith("~/")):
            node[key] = os.path.expanduser(value)


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Apply ``key=value``, ``+key=value`` and ``~key`` overrides to ``cfg`` in place."""
    for raw in overrides:
        if raw.startswith("~"):
            key = raw[1:]
            _check_key(key, raw)
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                raise ConfigError(
                    f"cannot delete {key!r} (override {raw!r}): no such key" + _suggest(cfg, key)
                )
            del parent[leaf]
            continue
        if "=" not in raw:
            hint = f"{raw.lstrip('-')}=VALUE"
            raise ConfigError(
                f"override {raw!r} is not of the form key=value, +key=value or ~key; "
                f"for example: {hint}"
            )
        key, value = raw.split("=", 1)
        add = key.startswith("+")
        key = key[1:] if add else key
        _check_key(key, raw)
        exists = (
            OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False) is not _MISSING
        )
        if add and exists:
            raise ConfigError(f"override {raw!r} adds {key!r}, which already exists; drop the '+'")
        if not add and not exists:
            raise ConfigError(
                f"unknown config key {key!r} (override {raw!r})"
                + _suggest(cfg, key)
                + f"; to add a new key write +{key}={value}"
            )
        try:
            # the value as written: ${...} in an override resolve with the config, later
            node = OmegaConf.from_dotlist([f"v={value}"])._get_node("v") if value else None
            if node is None:
                parsed = ""
            elif isinstance(node, DictConfig | ListConfig):
                parsed = OmegaConf.to_container(node, resolve=False)
            else:
                parsed = node._value()
        except Exception as e:  # omegaconf's and yaml's errors (a quote or bracket left open)
            msg = " ".join(str(e).split())
            raise ConfigError(f"cannot parse the value of override {raw!r}: {msg}") from e
        OmegaConf.update(cfg, key, parsed, merge=False, force_add=add)


def resolve(cfg: DictConfig) -> None:
    """Resolve every ``${...}`` in place; report the key path of broken ones and unset ``???``."""
    problems = []
    for path in leaf_paths(cfg):
        try:
            OmegaConf.select(cfg, path, throw_on_missing=True, throw_on_resolution_failure=True)
        except MissingMandatoryValue:
            problems.append(f"{path}: required value is not set (???); set it with {path}=VALUE")
        except OmegaConfBaseException as e:
            msg = str(e).splitlines()[0]
            problems.append(f"{path}: cannot resolve interpolation: {msg}")
    if problems:
        text = problems[0] if len(problems) == 1 else "invalid config:\n  " + "\n  ".join(problems)
        raise ConfigError(text, problems)
    # which values came from ${...}: a bad value is then reported once, at its source
    object.__setattr__(cfg, INTERPOLATED, frozenset(_interpolated_paths(cfg)))
    object.__setattr__(cfg, PER_LAUNCH, frozenset(_per_launch_paths(cfg)))
    OmegaConf.resolve(cfg)


INTERPOLATED = "_minippo_interpolated"  # attribute of a loaded config: keys that were ${...}
PER_LAUNCH = "_minippo_per_launch"  # attribute of a loaded config: keys that named ${now:...}


def _per_launch_paths(cfg: DictConfig) -> Iterator[str]:
    for path in leaf_paths(cfg):
        if "[" in path:
            continue
        parent_key, _, leaf = path.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        value = parent._get_node(leaf)._value() if isinstance(parent, DictConfig) else None
        if isinstance(value, str) and "${now:" in value:
            yield path


def _interpolated_paths(cfg: DictConfig) -> Iterator[str]:
    for path in leaf_paths(cfg):
        if "[" in path:
            continue
        parent_key, _, leaf = path.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if isinstance(parent, DictConfig) and OmegaConf.is_interpolation(parent, leaf):
            yield path


def leaf_paths(node: DictConfig | ListConfig, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every leaf value (lists are leaves unless they hold mappings)."""
    if isinstance(node, DictConfig):
        for key in node:
            path = _join(prefix, key)
            child = node._get_node(key)
            if isinstance(child, DictConfig) or (
                isinstance(child, ListConfig)
                and any(isinstance(c, DictConfig) for c in child._iter_ex(resolve=False))
            ):
                yield from leaf_paths(child, path)
            else:
                yield path
    else:
        for i, child in enumerate(node._iter_ex(resolve=False)):
            path = f"{prefix}[{i}]"
            if isinstance(child, DictConfig | ListConfig):
                yield from leaf_paths(child, path)
            else:
                yield path


def parse_recipe_args(argv: Sequence[str] | None = None, prog: str | None = None) -> DictConfig:
    """Parse a recipe script's arguments ``--config NAME_OR_PATH [key=value ...] [~key ...]``.

    This is what a recipe's ``if __name__ == "__main__":`` block calls; ``minippo run`` passes the
    same arguments to it, in one process or through torchrun.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a minippo recipe.",
        epilog="example: --config tiny_cpu total_steps=20 correction.reset_below=0.7 ~logger.log_dir",
    )
    parser.add_argument("--config", required=True, help="built-in config name or path to a YAML")
    parser.add_argument("overrides", nargs="*", help="key=value, +key=value or ~key")
    known, unknown = parser.parse_known_args(argv)
    check_no_flags(unknown)
    return load_config(known.config, [*known.overrides, *unknown])


def check_no_flags(args: Sequence[str]) -> None:
    """Refuse ``--flag``-style arguments where only overrides are allowed, showing the right form."""
    for i, arg in enumerate(args):
        if arg.startswith("-") and not arg.startswith("--config"):
            name, _, value = arg.lstrip("-").partition("=")
            name = name.replace("-", "_")
            following = args[i + 1] if i + 1 < len(args) else ""
            if not value and following and not following.startswith("-") and "=" not in following:
                value = following  # `--lr 3` -> lr=3
            raise ConfigError(
                f"unknown option {arg!r} after the recipe: config values are set as key=value, "
                f"for example `{name}={value or 'VALUE'}` (launcher flags such as --nproc-per-node "
                f"go before the recipe name)"
            )


def _check_key(key: str, raw: str) -> None:
    if not _KEY_RE.match(key):
        raise ConfigError(
            f"bad key {key!r} in override {raw!r}: keys are dotted names such as optimizer.lr"
        )


def _suggest(cfg: DictConfig, key: str) -> str:
    keys = [k for k in _all_keys(cfg) if not k.endswith("._component_")]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if not close:
        leaf = key.rpartition(".")[2]
        close = [k for k in keys if k.rpartition(".")[2] == leaf][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def _all_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    for key in node:
        path = _join(prefix, key)
        yield path
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            yield from _all_keys(child, path)
