"""Metric loggers behind one interface.

Every logger has ``log(metrics, step)``, ``log_config(cfg)`` and ``close()``. Metric names are
namespaced (``train/``, ``rollout/``, ``correction/``, ``perf/``) and values are plain floats.

* :class:`JsonlLogger` (the default): one JSON object per line, ``{"step": k, "name": value, ...}``;
  tests and plotting scripts read it with :func:`read_jsonl`.
* :class:`StdoutLogger`: one compact line per step.
* :class:`TensorBoardLogger`, :class:`WandBLogger`: optional; their packages are imported only when
  the logger is built, with an error that names the package to install.
* :class:`NoOpLogger` (what non-zero ranks use) and :class:`MultiLogger` (several at once).

Aggregation: :class:`MetricAverager` folds per-micro-batch stats into one value per step
(token-weighted means; ``*_max`` keys keep the largest value), :func:`reduce_over_ranks` folds the
ranks' metrics (``*_max`` / ``*_min`` keys take the max / min, the rest the mean).

In a config::

    metric_logger:
      _component_: minippo.training.metrics.JsonlLogger
      path: ${output_dir}/metrics.jsonl
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable


@runtime_checkable
class MetricLogger(Protocol):
    """What the recipe calls; every logger below implements it."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> float) for training step ``step``."""
        ...

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the resolved run config once, at the start."""
        ...

    def close(self) -> None:
        """Flush and release files / connections; idempotent."""
        ...


def _to_float(name: str, value: Any) -> float:
    """A metric value as a Python float (tensors, numpy scalars, ints, bools accepted)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    raise TypeError(
        f"metric {name!r} has a value of type {type(value).__name__} ({value!r}); metrics must "
        "be numbers (use .item() on tensors)"
    )


def _json_float(x: float) -> float | str:
    """JSON has no NaN/inf: write them as the strings "nan", "inf", "-inf"."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


class NoOpLogger:
    """Logs nothing (non-zero ranks, or ``metric_logger: null``)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Append one JSON line per ``log`` call to ``path`` (created with its parent folders).

    Line format: ``{"step": 3, "train/loss": 0.12, ...}``; non-finite values are written as the
    strings ``"nan"`` / ``"inf"`` / ``"-inf"`` so that every line is strict JSON.

    Resuming: the first ``log(metrics, step=s)`` keeps the rows of an existing file with a step
    below ``s`` and drops the others. A fresh run (first step 0) therefore starts the file anew,
    and a run resumed at step ``s`` continues it without duplicating the rows that the interrupted
    run logged after its last checkpoint. A partial last line (a run killed while writing it) is
    dropped with a warning; a damaged line elsewhere is an error naming the file and the line.

    Args:
        path: the .jsonl file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None
        self._closed = False

    def _open(self, first_step: int) -> IO[str]:
        kept = []
        if self.path.is_file():
            for line, row in _rows(self.path):
                if row["step"] < first_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        return open(self.path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"JsonlLogger({self.path}) is closed")
        if self._file is None:
            self._file = self._open(int(step))
        row: dict[str, Any] = {"step": int(step)}
        row.update({k: _json_float(_to_float(k, v)) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config goes next to the metrics, not into them (the jsonl stays one row
        per step): ``<stem>_config.json`` for the first launch, ``<stem>_config.2.json``,
        ``.3``, ... for each resume, so the record of every launch is kept."""
        path, n = self.path.with_name(self.path.stem + "_config.json"), 1
        while path.exists():
            n += 1
            path = self.path.with_name(f"{self.path.stem}_config.{n}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, default=str)

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, float]]:
    """The rows a :class:`JsonlLogger` wrote, with "nan"/"inf" strings turned back into floats."""
    return [
        {k: float(v) if isinstance(v, str) else v for k, v in row.items()} for _, row in _rows(path)
    ]


def _rows(path: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) of a metrics file; a partial last line (a run killed mid-write) is dropped
    with a warning, a damaged line elsewhere raises ValueError naming it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a metrics row")
        except ValueError:
            if i == len(lines) - 1:
                logging.getLogger(__name__).warning(
                    "%s: dropped its partial last line (a run stopped while writing it)", path
                )
                break
            raise ValueError(
                f"{path}: line {i + 1} is not a metrics row (damaged file); delete the line or "
                "the file"
            ) from None
        out.append((line, row))
    return out


class StdoutLogger:
    """One line per step: ``step 3 | train/loss 0.1200 | rollout/reward_mean 0.4000``.

    Args:
        keys: only print these names (all when None).
        stream: where to write (default sys.stdout).
    """

    def __init__(self, keys: Sequence[str] | None = None, stream: IO[str] | None = None) -> None:
        self.keys = list(keys) if keys is not None else None
        self.stream = stream

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        names = self.keys if self.keys is not None else sorted(metrics)
        parts = [f"step {step}"]
        parts += [f"{k} {_to_float(k, metrics[k]):.4g}" for k in names if k in metrics]
        print(" | ".join(parts), file=self.stream or sys.stdout, flush=True)

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars to a TensorBoard event folder (needs ``pip install tensorboard``).

    Args:
        log_dir: the event folder.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError when tensorboard is missing
            raise ImportError(
                "TensorBoardLogger needs the `tensorboard` package, which is not installed: "
                "run `pip install tensorboard`, or use "
                "metric_logger._component_=minippo.training.metrics.JsonlLogger"
            ) from e
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, _to_float(k, v), global_step=step)
        self._writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text(
            "config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```"
        )

    def close(self) -> None:
        self._writer.close()


class WandBLogger:
    """Weights & Biases run (needs ``pip install wandb`` and a login or ``WANDB_MODE=offline``).

    Args:
        project: the W&B project.
        name: the run name (None: W&B picks one).
        log_dir: where W&B keeps its local files.
        **kwargs: passed to ``wandb.init`` (entity, group, tags, mode, ...).
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        log_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "WandBLogger needs the `wandb` package, which is not installed: run "
                "`pip install wandb`, or use "
                "metric_logger._component_=minippo.training.metrics.JsonlLogger"
            ) from e
        self._wandb = wandb
        self._run = wandb.init(
            project=project, name=name, dir=str(log_dir) if log_dir else None, **kwargs
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log({k: _to_float(k, v) for k, v in metrics.items()}, step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Send every call to each of ``loggers`` (already built loggers)."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        for i, lg in enumerate(loggers):
            if not isinstance(lg, MetricLogger):
                raise TypeError(
                    f"MultiLogger: item {i} is a {type(lg).__name__}, not a logger with "
                    "log/log_config/close; give built loggers (nodes with a _component_)"
                )
        self.loggers = list(loggers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_config(config)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


# ----------------------------------------------------------------------------------------------
# Aggregation


def _extreme(key: str):
    return max if key.endswith("_max") else min if key.endswith("_min") else None


class MetricAverager:
    """Accumulate stats over micro-batches / minibatches into one value per key.

    ``add(stats, weight)``: a key's result is ``Σ weight · value / Σ weight`` (pass a micro-batch's
    response-token count for per-token stats, the default 1 for per-minibatch values such as
    losses and gradient norms); a ``*_max`` / ``*_min`` key keeps the largest / smallest value.
    A key whose weights sum to 0 comes out NaN. Values and weights may be 0-dim tensors: they are
    accumulated on their device in float64 and copied to the host once, by ``result()``.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}
        self._weights: dict[str, Any] = {}
        # 0-dim tensor values of one add() call, one vector per dtype and device:
        # (keys, dtype, device) -> [Σ weight · values (float64 vector), Σ weight]
        self._groups: dict[tuple, list] = {}

    def add(self, stats: Mapping[str, Any], weight: Any = 1.0) -> None:
        import torch

        w = _f64(weight)
        vectors: dict[Any, list[tuple[str, Any]]] = {}  # (dtype, device) -> its (key, tensor)s
        for k, v in stats.items():
            extreme = _extreme(k)
            if extreme is None and isinstance(v, torch.Tensor) and v.dim() == 0:
                vectors.setdefault((v.dtype, v.device), []).append((k, v))
                continue
            v = _f64(v)
            if extreme is not None:
                old = self._sums.get(k, v)
                both = isinstance(old, float) and isinstance(v, float)
                self._sums[k] = extreme(old, v) if both else _tensor_extreme(k, old, v)
                self._weights[k] = 1.0
            else:
                self._sums[k] = self._sums.get(k, 0.0) + v * w
                self._weights[k] = self._weights.get(k, 0.0) + w
        for where, items in vectors.items():  # the same float64 arithmetic, per element
            values = torch.stack([v.detach() for _, v in items]).to(torch.float64)
            group = self._groups.setdefault((tuple(k for k, _ in items), *where), [0.0, 0.0])
            group[0] = group[0] + values * w
            group[1] = group[1] + w

    def result(self) -> dict[str, float]:
        keys = list(self._sums)
        parts: list[Any] = [self._sums[k] for k in keys] + [self._weights[k] for k in keys]
        for group_sums, group_weight in self._groups.values():
            parts += [*group_sums.unbind(), group_weight]
        values = _to_host(parts)
        n = len(keys)
        sums = dict(zip(keys, values[:n]))
        weights = dict(zip(keys, values[n : 2 * n]))
        at = 2 * n
        for group_keys, *_ in self._groups:  # a key in several groups: their sums and weights
            w = values[at + len(group_keys)]
            for i, k in enumerate(group_keys):
                sums[k] = sums.get(k, 0.0) + values[at + i]
                weights[k] = weights.get(k, 0.0) + w
            at += len(group_keys) + 1
        return {k: s / w if (w := weights[k]) else math.nan for k, s in sums.items()}


def _f64(x: Any) -> Any:
    """A tensor as float64 on its device, anything else as a Python float."""
    import torch

    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def _tensor_extreme(key: str, a: Any, b: Any) -> Any:
    import torch

    pick = torch.maximum if key.endswith("_max") else torch.minimum
    device = next(x.device for x in (a, b) if isinstance(x, torch.Tensor))
    as_t = [torch.as_tensor(x, dtype=torch.float64, device=device) for x in (a, b)]
    return pick(*as_t)


def _to_host(values: list[Any]) -> list[float]:
    """Python floats of a list of floats and tensors: one device-to-host copy for all tensors."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    device = tensors[0].device
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    return stacked.tolist()


def gather_and_reduce(
    metrics: Mapping[str, float], summed: Collection[str] = ()
) -> dict[str, float]:
    """This rank's metrics reduced with every rank's (:func:`reduce_over_ranks`; collective under
    torch.distributed, the metrics unchanged in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(metrics)
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, dict(metrics))
    return reduce_over_ranks(gathered, summed)


def reduce_over_ranks(
    per_rank: Sequence[Mapping[str, float]], summed: Collection[str] = ()
) -> dict[str, float]:
    """One metrics dict from every rank's: ``*_max`` keys take the max, ``*_min`` the min, keys in
    ``summed`` the sum (e.g. each rank's share of a loss), the rest the mean over the ranks that
    have the key."""
    out = {}
    for k in sorted(set().union(*per_rank)):
        vals = [m[k] for m in per_rank if k in m]
        extreme = _extreme(k)
        if extreme is not None:
            out[k] = extreme(vals)
        else:
            out[k] = sum(vals) if k in summed else sum(vals) / len(vals)
    return out
