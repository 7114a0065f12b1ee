"""``_component_`` instantiation and signature checks (torchtune conventions).

A config node such as

    optimizer:
      _component_: torch.optim.AdamW
      lr: 1e-5

is built by ``instantiate(cfg.optimizer, model.parameters())``: positional arguments come from the
caller, keyword arguments from the node, and keyword arguments given by the caller override the node.
Nested nodes that have a ``_component_`` are built first; other nested mappings and lists become plain
Python dicts and lists.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from minippo.config._errors import ConfigError

COMPONENT = "_component_"


def locate(dotpath: str, key_path: str = COMPONENT) -> Callable[..., Any]:
    """Import ``a.b.C`` and return ``C``; errors name the config key and suggest close names."""
    if not isinstance(dotpath, str) or not dotpath or dotpath.startswith("."):
        raise ConfigError(
            f"{key_path}: {dotpath!r} is not a dotted import path like torch.optim.AdamW"
        )
    parts = dotpath.split(".")
    module, n = None, len(parts)
    while n > 0:
        try:
            module = importlib.import_module(".".join(parts[:n]))
            break
        except ModuleNotFoundError as e:
            # Only keep walking up when the missing module is the one we asked for, not a
            # dependency that it failed to import.
            if e.name is None or not ".".join(parts[:n]).startswith(e.name):
                raise ConfigError(f"{key_path}: importing {dotpath!r} failed: {e}") from e
            n -= 1
    if module is None:
        raise ConfigError(f"{key_path}: cannot import {dotpath!r}: no module named {parts[0]!r}")
    obj: Any = module
    for i, attr in enumerate(parts[n:], start=n):
        if not hasattr(obj, attr):
            where = ".".join(parts[:i])
            names = [x for x in dir(obj) if not x.startswith("_")]
            lower = {x.lower(): x for x in names}
            close = [lower[c] for c in difflib.get_close_matches(attr.lower(), list(lower), n=3)]
            hint = f"; did you mean {', '.join(where + '.' + c for c in close)}?" if close else ""
            raise ConfigError(
                f"{key_path}: cannot import {dotpath!r}: {where!r} has no {attr!r}{hint}"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(f"{key_path}: {dotpath!r} is not callable")
    return obj


def instantiate(node: DictConfig | dict | None, *args: Any, **kwargs: Any) -> Any:
    """Build the object described by a ``_component_`` node; ``None`` gives ``None``.

    Args:
        node: a DictConfig (or dict) with a ``_component_`` key naming a callable.
        *args: positional arguments passed first (objects the recipe owns: parameters, a model).
        **kwargs: keyword arguments that override the node's values.
    """
    if node is None:
        return None
    if isinstance(node, dict):
        node = OmegaConf.create(node)
    if not isinstance(node, DictConfig) or COMPONENT not in node:
        raise ConfigError(f"{_key(node)}: instantiate needs a mapping with a {COMPONENT} key")
    path = _key(node)
    target = locate(node[COMPONENT], _join(path, COMPONENT))
    cfg_kwargs = {k: _build(node[k], _join(path, k)) for k in node if k != COMPONENT}
    cfg_kwargs.update(kwargs)
    _bind(target, args, cfg_kwargs, path, partial=False)
    return target(*args, **cfg_kwargs)


def validate(cfg: DictConfig) -> list[str]:
    """Every problem of every ``_component_`` node, one line each, prefixed by its key path.

    Targets must import and the node's keys must bind to the target's signature. Arguments the
    recipe passes at run time (parameters, a model, a tokenizer) cannot be known here, so missing
    required arguments are not reported; unknown or duplicated ones are.
    """
    problems = []
    for path, node in component_nodes(cfg):
        key = _join(path, COMPONENT)
        try:
            target = locate(node[COMPONENT], key)
        except ConfigError as e:
            problems.append(str(e))
            continue
        try:
            _bind(target, (), {k: None for k in node if k != COMPONENT}, path, partial=True)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def component_nodes(node: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """(key path, node) of every mapping with a ``_component_`` key, outermost first."""
    if isinstance(node, DictConfig):
        if COMPONENT in node:
            yield path, node
        for k in node:
            yield from component_nodes(node._get_node(k), _join(path, k))
    elif isinstance(node, ListConfig):
        for i, child in enumerate(node._iter_ex(resolve=False)):
            yield from component_nodes(child, f"{path}[{i}]")


def _build(value: Any, path: str) -> Any:
    """A resolved config value as the plain Python object handed to a constructor."""
    if isinstance(value, DictConfig):
        if COMPONENT in value:
            return instantiate(value)
        return {k: _build(value[k], _join(path, k)) for k in value}
    if isinstance(value, ListConfig):
        return [_build(c, f"{path}[{i}]") for i, c in enumerate(value)]
    return value


def _bind(target: Callable, args: tuple, kwargs: dict, path: str, *, partial: bool) -> None:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return
    try:
        (sig.bind_partial if partial else sig.bind)(*args, **kwargs)
    except TypeError as e:
        accepted = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        where = path or "<root>"
        name = getattr(target, "__qualname__", repr(target))
        extra = ""
        unknown = [k for k in kwargs if k not in sig.parameters]
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        if unknown and not has_var_kw:
            close = {k: difflib.get_close_matches(k, accepted, n=1) for k in unknown}
            extra = "; unknown keys: " + ", ".join(
                _join(path, k) + (f" (did you mean {c[0]}?)" if c else "") for k, c in close.items()
            )
        what = extra.removeprefix("; ") if extra else str(e)
        raise ConfigError(
            f"{where}: {what} for {name}; accepted keys: {', '.join(accepted)}"
        ) from e


def _key(node: Any) -> str:
    try:
        return str(node._get_full_key(None) or "")
    except Exception:
        return ""


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
