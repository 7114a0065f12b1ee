"""Declared config keys: the type and range of each value, unknown keys with close matches.

A recipe declares the keys it reads as a schema, a mapping ``key -> spec``::

    SCHEMA = {
        "total_steps": Int(min=1),
        "rollout": Section({"temperature": Float(min=0), "top_p": Float(gt=0, max=1)}),
        "optimizer": Component({"lr": Float(gt=0)}),
    }
    problems = check_schema(cfg, SCHEMA)  # one line per problem, key path first; [] when fine

Every problem is reported, not the first: a value of the wrong type or out of range, a required
key that is missing, and a key the schema does not declare (almost always a typo in a YAML file or
an override, which would otherwise be ignored silently), with the closest declared keys.

A :class:`Section` is a mapping whose keys are all declared. A :class:`Component` is a
``_component_`` node: its keys are the callable's arguments, checked against its signature by
:func:`minippo.config.validate`; the keys it declares here are also checked for type and range.
To read a new key in a copied recipe, add it to the recipe's schema
(``SCHEMA = {**ASYNC_PPO_SCHEMA, "my_key": Int(min=0)}``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig

from minippo.config.dtypes import DTYPE_NAMES

__all__ = [
    "Anything",
    "Bool",
    "Component",
    "Dtype",
    "Float",
    "Int",
    "Section",
    "Spec",
    "Str",
    "check_schema",
    "declared_default",
    "declared_defaults",
]


NO_DEFAULT: Any = object()  # a Spec without a default: the key must be set or is read as absent


class Spec:
    """One declared key. ``null``: ``null`` is a valid value; ``optional``: the key may be absent;
    ``default``: the value an absent key stands for (implies ``optional``), stated here once and
    read through :func:`declared_default` (``minippo.training.preflight.setting``) by every reader
    of the key."""

    def __init__(self, *, null: bool = False, optional: bool = False, default: Any = NO_DEFAULT):
        self.null = null
        self.default = default
        self.optional = optional or default is not NO_DEFAULT

    def describe(self) -> str:
        """What a valid value is, as in "total_steps must be <this>"."""
        return "any value"

    def problem(self, path: str, value: Any) -> str | None:
        """The problem with ``value`` at ``path``, or None."""
        if value is None:
            return None if self.null else f"{path} must be {self.describe()}, got null"
        if not self._ok(value):
            return f"{path} must be {self.describe()}, got {value!r}"
        return None

    def _ok(self, value: Any) -> bool:
        return True

    def _or_null(self, text: str) -> str:
        return f"{text} or null" if self.null else text


class Anything(Spec):
    """Any value (null included)."""

    def __init__(self, *, optional: bool = False, default: Any = NO_DEFAULT) -> None:
        super().__init__(null=True, optional=optional, default=default)


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


class _Number(Spec):
    kind = "a number"

    def __init__(
        self,
        *,
        min: float | None = None,
        max: float | None = None,
        gt: float | None = None,
        lt: float | None = None,
        null: bool = False,
        optional: bool = False,
        default: Any = NO_DEFAULT,
    ) -> None:
        super().__init__(null=null, optional=optional, default=default)
        self.lo, self.lo_open = (gt, True) if gt is not None else (min, False)
        self.hi, self.hi_open = (lt, True) if lt is not None else (max, False)

    def describe(self) -> str:
        bound = _interval(self.lo, self.hi, self.lo_open, self.hi_open)
        return self._or_null(f"{self.kind} {bound}".strip())

    def _typed(self, value: Any) -> bool:
        raise NotImplementedError

    def _ok(self, value: Any) -> bool:
        if not self._typed(value) or not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))


class Int(_Number):
    """An integer (``true``/``false`` are not integers), optionally bounded."""

    kind = "an integer"

    def _typed(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


class Float(_Number):
    """A finite number (an integer is accepted), optionally bounded: ``min``/``max`` are
    inclusive, ``gt``/``lt`` exclusive."""

    def _typed(self, value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)


class Bool(Spec):
    """``true`` or ``false``."""

    def describe(self) -> str:
        return self._or_null("true or false")

    def _ok(self, value: Any) -> bool:
        return isinstance(value, bool)


class Str(Spec):
    """A string, optionally one of ``choices``."""

    def __init__(
        self,
        choices: Sequence[str] | None = None,
        *,
        null: bool = False,
        optional: bool = False,
        default: Any = NO_DEFAULT,
    ) -> None:
        super().__init__(null=null, optional=optional, default=default)
        self.choices = sorted(choices) if choices is not None else None

    def describe(self) -> str:
        what = f"one of {self.choices}" if self.choices is not None else "a string"
        return self._or_null(what)

    def _ok(self, value: Any) -> bool:
        return isinstance(value, str) and (self.choices is None or value in self.choices)


class Dtype(Spec):
    """A dtype name, either spelling (``bf16`` / ``bfloat16``, ...)."""

    def describe(self) -> str:
        return self._or_null(f"a dtype, one of {', '.join(sorted(DTYPE_NAMES))}")

    def _ok(self, value: Any) -> bool:
        return isinstance(value, str) and value in DTYPE_NAMES


class Section(Spec):
    """A mapping whose keys are all declared in ``keys``."""

    def __init__(
        self,
        keys: Mapping[str, Spec],
        *,
        null: bool = False,
        optional: bool = False,
        default: Any = NO_DEFAULT,
    ) -> None:
        super().__init__(null=null, optional=optional, default=default)
        self.keys = dict(keys)

    def describe(self) -> str:
        return self._or_null("a mapping")


class Component(Section):
    """A ``_component_`` node; ``keys`` lists the arguments checked for type and range (the
    others are checked against the callable's signature by ``minippo.config.validate``)."""

    def __init__(
        self,
        keys: Mapping[str, Spec] | None = None,
        *,
        null: bool = False,
        optional: bool = False,
        default: Any = NO_DEFAULT,
    ) -> None:
        keys = {k: _as_optional(s) for k, s in (keys or {}).items()}
        super().__init__(keys, null=null, optional=optional, default=default)

    def describe(self) -> str:
        return self._or_null("a mapping with a _component_ key")


def _as_optional(spec: Spec) -> Spec:
    spec.optional = True  # a callable's argument may be left to its default
    return spec


def check_schema(cfg: DictConfig, schema: Mapping[str, Spec]) -> list[str]:
    """Every problem of ``cfg`` against ``schema``, one line each (see the module docstring)."""
    declared = sorted(_declared(schema))
    problems = list(_check_mapping(cfg, schema, "", declared, closed=True))
    # a key set by ${other} repeats other's bad value: report it once, at its source
    interpolated = getattr(cfg, "_minippo_interpolated", None) or frozenset()
    values = [p.rpartition(", got ")[2] for p in problems]
    return [
        p
        for i, p in enumerate(problems)
        if p.partition(" must be ")[0] not in interpolated
        or values[i] not in values[:i] + values[i + 1 :]
    ]


def _check_mapping(
    node: DictConfig, keys: Mapping[str, Spec], prefix: str, declared: list[str], *, closed: bool
) -> Iterator[str]:
    suggested: set[str] = set()
    for key in node:
        path = f"{prefix}{key}"
        if key not in keys:
            if closed:
                close = _close_keys(path, [f"{prefix}{k}" for k in keys], declared)
                suggested.update(close)
                hint = f"; did you mean {', '.join(close)}?" if close else "; fix or delete it"
                yield f"unknown config key {path!r} (the recipe does not read it){hint}"
            continue
        yield from _check_value(node[key], keys[key], path, declared)
    for key, spec in keys.items():
        path = f"{prefix}{key}"
        if key not in node and not spec.optional and path not in suggested:
            yield f"missing config key {path!r} ({spec.describe()}); add it to the config"


def _check_value(value: Any, spec: Spec, path: str, declared: list[str]) -> Iterator[str]:
    if isinstance(spec, Section):
        if value is None:
            if not spec.null:
                yield f"{path} must be {spec.describe()}, got null"
            return
        if not isinstance(value, DictConfig):
            yield f"{path} must be {spec.describe()}, got {_show(value)}"
            return
        if isinstance(spec, Component) and "_component_" not in value:
            yield (
                f"{path} has no _component_ key: it must name what to build, e.g. "
                f"{path}._component_=<module.Class>"
            )
        closed = not isinstance(spec, Component)
        yield from _check_mapping(value, spec.keys, f"{path}.", declared, closed=closed)
        return
    if isinstance(value, DictConfig | ListConfig) and not isinstance(spec, Anything):
        yield f"{path} must be {spec.describe()}, got {_show(value)}"
        return
    problem = spec.problem(path, value)
    if problem is not None:
        yield problem


def _show(value: Any) -> str:
    return (
        "a mapping"
        if isinstance(value, DictConfig)
        else "a list"
        if isinstance(value, ListConfig)
        else repr(value)
    )


def _close_keys(path: str, siblings: list[str], declared: list[str]) -> list[str]:
    """The declared keys closest to a misspelled ``path``: its section's first, then any."""
    for candidates in (siblings, declared):
        scored = sorted(
            ((difflib.SequenceMatcher(None, path, c).ratio(), c) for c in candidates), reverse=True
        )
        best = scored[0][0] if scored else 0.0
        close = [c for r, c in scored if r >= 0.6 and r >= best - 0.05][:3]
        if close:
            return close
    leaf = path.rpartition(".")[2]
    return [d for d in declared if d.rpartition(".")[2] == leaf][:3]


def _declared(keys: Mapping[str, Spec], prefix: str = "") -> Iterator[str]:
    for key, spec in keys.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(spec, Section):
            yield from _declared(spec.keys, f"{path}.")


def declared_default(schema: Mapping[str, Spec], key: str) -> Any:
    """The default the schema states for the dotted ``key`` (``rollout.sync_every``); KeyError when
    the key is not declared or has no default."""
    keys: Mapping[str, Spec] = schema
    *sections, leaf = key.split(".")
    for name in sections:
        spec = keys.get(name)
        if not isinstance(spec, Section):
            raise KeyError(f"{key}: {name} is not a declared section")
        keys = spec.keys
    spec = keys.get(leaf)
    if spec is None or spec.default is NO_DEFAULT:
        raise KeyError(f"{key} has no declared default")
    return spec.default


def declared_defaults(schema: Mapping[str, Spec], prefix: str = "") -> dict[str, Any]:
    """{dotted key: default} of every key the schema gives a default."""
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        key = f"{prefix}{name}"
        if spec.default is not NO_DEFAULT:
            out[key] = spec.default
        if isinstance(spec, Section):
            out.update(declared_defaults(spec.keys, prefix=key + "."))
    return out
