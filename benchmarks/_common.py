"""Helpers shared by the benchmark scripts: running the recipe through the CLI, reading its
metrics, counting live tensor bytes, describing the machine, printing tables.

Scripts in this folder run as ``python benchmarks/<name>.py``, so this module is imported as
``_common`` (the script's folder is first on ``sys.path``); tests, run from the repository root,
import it as ``benchmarks._common``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from minippo.training.metrics import read_jsonl

REPO = Path(__file__).resolve().parent.parent
DOCS_IMG = REPO / "docs" / "img"
DEFAULT_OUT = Path(os.environ.get("TMPDIR", "/tmp")) / "minippo_bench"
# tiny_cpu's step before it went to 8 samples per prompt, bounded each actor update and peaked at
# lr 5e-3: the benchmarks whose documented figures were measured with it keep it, so that a rerun
# measures the same work
TINY_CPU_AS_MEASURED = [
    "rollout.samples_per_prompt=4",
    "ppo.max_update_kl=null",
    "optimizer.lr=3.0e-3",
]

# Keys every benchmark run of the recipe sets: no progress bar, no periodic checkpoint or HF export
# (the recipe still saves one checkpoint at the last step).
QUIET_RUN = [
    "progress_bar=false",
    "checkpoint.every_n_steps=100000",
    "checkpoint.export_hf=false",
]


# ----------------------------------------------------------------------------------------------
# Measuring: live tensor bytes on any device (CPU included)


class TensorMemoryTracker(TorchDispatchMode):
    """Bytes of live tensor storages, and their peak, per device type.

    Every tensor an op creates under the tracker is counted until its storage is freed (a weak
    reference callback); tensors that exist before (a model's parameters, an optimizer's state)
    are added with :meth:`track`. Subclass tensors (torchao's quantized optimizer states) count
    their inner storages. DTensor ops are let through so that their local ops are what is counted.

    Example::

        tracker = TensorMemoryTracker()
        tracker.track(model)
        with tracker:
            loss = model(x).sum(); loss.backward(); opt.step()
        tracker.peak["cpu"]
    """

    def __init__(self) -> None:
        super().__init__()
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def track(self, *objs: Any) -> TensorMemoryTracker:
        """Count tensors that already exist: modules (parameters, buffers, grads), optimizers
        (state), tensors, or containers of them."""
        for obj in objs:
            if isinstance(obj, nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    self._add(t)
                    if t.grad is not None:
                        self._add(t.grad)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    self.track(list(state.values()))
            elif isinstance(obj, torch.Tensor):
                self._add(obj)
            else:
                leaves, _ = tree_flatten(obj)
                if leaves == [obj]:  # not a container: nothing to count
                    continue
                self.track(*leaves)
        return self

    def _add(self, t: torch.Tensor) -> None:
        if type(t).__name__ == "DTensor":
            t = t.to_local()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for n in names:
                inner = getattr(t, n)
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
            return
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._refs and self._refs[key]() is st:
            return
        nbytes, dev = st.nbytes(), t.device.type

        def freed(_ref, nbytes=nbytes, dev=dev, key=key):
            self.current[dev] -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, freed)
        self.current[dev] = self.current.get(dev, 0) + nbytes
        if self.current[dev] > self.peak.get(dev, 0):
            self.peak[dev] = self.current[dev]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


@dataclass
class RecipeRun:
    """One finished ``minippo run async_ppo`` subprocess.

    Fields:
        overrides:  the key=value overrides it ran with.
        out_dir:    its output_dir (metrics.jsonl inside).
        returncode: exit status (0 = success).
        wall_s:     wall-clock seconds of the whole process (start-up included).
        maxrss_mib: peak resident set of the trainer process tree (``ru_maxrss`` from ``wait4``:
                    the largest of the process and its reaped children, e.g. the engine process).
        metrics:    one dict per logged step, in step order.
        log_tail:   the last lines of stdout+stderr (for error reports).
    """

    overrides: list[str]
    out_dir: Path
    returncode: int
    wall_s: float
    maxrss_mib: float
    metrics: list[dict] = field(default_factory=list)
    log_tail: str = ""

    def series(self, key: str) -> list[float]:
        """The values of ``key`` per step (steps that did not log it are skipped)."""
        return [float(m[key]) for m in self.metrics if key in m]


def read_metrics(path: Path) -> list[dict]:
    """The step records of a JsonlLogger file, in step order (records without a ``step`` are
    skipped; "nan"/"inf" strings are read back as floats by ``read_jsonl``)."""
    if not path.is_file():
        return []
    return sorted((r for r in read_jsonl(path) if "step" in r), key=lambda r: r["step"])


CORRECTION_BYTES_KEYS = (
    "correction/snapshot_bytes",
    "correction/ewma_bytes",
    "correction/swap_buffer_bytes",
)


def correction_bytes(run: RecipeRun) -> float:
    """Largest bytes held by the correction at any step: snapshots or EWMA copy + swap buffer."""
    return max(
        (sum(m.get(k, 0.0) for k in CORRECTION_BYTES_KEYS) for m in run.metrics), default=0.0
    )


def rss_bytes() -> int:
    """Resident set size of this process now (``/proc/self/statm``, Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_recipe(
    overrides: Sequence[str],
    out_dir: Path,
    *,
    config: str = "tiny_cpu",
    threads: int = 1,
    timeout: float = 1800.0,
) -> RecipeRun:
    """Run ``minippo run async_ppo --config <config> output_dir=<out_dir> <overrides>``.

    ``threads`` sets OMP_NUM_THREADS / MKL_NUM_THREADS of the trainer process (the TorchEngine
    process picks its own count: 1 on a 2-core machine). The peak RSS is read from ``wait4``'s
    rusage of this very child, so several runs may execute in parallel threads.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = out_dir / "metrics.jsonl"
    if metrics_file.exists():
        metrics_file.unlink()  # the JsonlLogger appends only on resume; start clean
    cmd = [sys.executable, "-m", "minippo", "run", "async_ppo", "--config", config]
    # the folder is this benchmark's scratch space: a run replaces the outputs of the last one
    cmd += [f"output_dir={out_dir}", "overwrite_output_dir=true", *QUIET_RUN, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_path = out_dir / "run.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    tail = "\n".join(log_path.read_text().splitlines()[-15:])
    return RecipeRun(
        overrides=list(overrides),
        out_dir=out_dir,
        returncode=proc.returncode,
        wall_s=wall,
        maxrss_mib=usage.ru_maxrss / 1024,  # Linux: kilobytes
        metrics=read_metrics(metrics_file),
        log_tail=tail,
    )


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def machine() -> str:
    """One line: CPU model, cores, RAM, torch and Python versions, current load average."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        ram = f"{kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        ram = "RAM unknown"
    return (
        f"{cpu}, {os.cpu_count()} cores, {ram}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, load average {load_average():.2f}"
    )


# two-sided 95% Student-t quantiles by degrees of freedom (n - 1); 1.96 beyond
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ci95(xs: Sequence[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean of ``xs`` (0 for fewer than 2)."""
    if len(xs) < 2:
        return 0.0
    return T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned (columns whose first cell is a number)."""

    def cell(x: object) -> str:
        return f"{x:,.3g}" if isinstance(x, float) else str(x)

    align = [
        "---:" if rows and isinstance(rows[0][i], (int, float)) else "---"
        for i in range(len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def save_figure(fig, name: str, out_dir: Path, write_docs: bool) -> list[Path]:
    """Save a matplotlib figure as ``<out_dir>/<name>`` and, with ``write_docs``, also as
    ``docs/img/<name>``. Returns the paths written."""
    paths = [Path(out_dir) / name]
    if write_docs:
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        paths.append(DOCS_IMG / name)
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110, bbox_inches="tight")
    return paths
