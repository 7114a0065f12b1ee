"""Process-level care for the SGLang backend: the environment the engine starts with, what a rank
does when its engine dies, and the check of published weight names and shapes.

Nothing here imports SGLang. ``minippo.engine.sglang_engine`` uses these helpers; they live apart
because they concern the training process around the engine rather than the engine's API.

Engine death. In sglang 0.5.23 any exception in the scheduler process (a failed assert or shape
check in ``load_weights``, the idle assert of ``release_memory_occupation``, a resume of a memory
tag that was never released, a CUDA OOM in a forward pass) is logged by the scheduler as
``Scheduler hit an exception: <traceback>`` and answered with SIGQUIT to its parent, the training
rank; a child that dies without a traceback (the OOM killer) is reported the same way by SGLang's
subprocess watchdog. SGLang's own SIGQUIT handler then SIGKILLs the whole process tree, this rank
included: no Python traceback, no ``finally`` blocks. The backend instead hands SGLang
:func:`on_engine_death` as its ``custom_sigquit_handler`` (a ServerArgs field; a module-level
function, so that the server arguments still pickle into the spawned scheduler). It

1. writes ONE line to stderr naming the rank, the protocol call and the tokenizer-manager call in
   progress, the exit codes of the engine's child processes, and where the scheduler's traceback
   is (this process's stderr, just above: the scheduler shares it);
2. marks every live engine of this process dead, so that threads blocked in an engine call (the
   rollout queue's ``generate``) raise :class:`SGLangEngineDied` within a fraction of a second;
3. raises :class:`SGLangEngineDied` in the main thread (where Python runs signal handlers), so the
   rank unwinds with a Python traceback and torchrun sees it fail;
4. arms a timer that ends the process with exit code ``DEATH_EXIT_CODE`` after
   ``DEATH_EXIT_GRACE_S`` seconds if it is still alive (a rank must not outlive its engine; the
   other ranks would wait for it in their next collective).

A handler runs when the main thread next executes Python code: if it is inside a long C call
(an NCCL collective), the line comes when that call returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minippo.models import ModelArgs

# torchrun sets it in every worker; a process that inherits it and calls init_process_group with a
# tcp:// address becomes a client of a TCPStore that nobody serves (torch < 2.14.1: a >= 10 min hang)
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
CONTEXT_OVERRIDE_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
DEATH_EXIT_GRACE_S = 30.0
DEATH_EXIT_CODE = 70  # EX_SOFTWARE

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # engines of this process (SGLangEngine)


class SGLangEngineDied(RuntimeError):
    """The SGLang engine of this rank died (its scheduler failed); the rank cannot continue."""


def register_engine(engine: Any) -> None:
    """Track ``engine`` (an object with ``_death_report() -> str`` and ``_mark_dead(str)``)."""
    _LIVE.add(engine)


def unregister_engine(engine: Any) -> None:
    _LIVE.discard(engine)


def _rank_label() -> str:
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else "this process"


def on_engine_death(signum: int, frame: Any) -> None:
    """SIGQUIT handler given to SGLang (``custom_sigquit_handler``): make the engine's death loud.

    See the module docstring. Raises :class:`SGLangEngineDied` (in the main thread, where Python
    runs signal handlers).
    """
    engines = list(_LIVE)
    reports = [e._death_report() for e in engines] or ["no live SGLangEngine in this process"]
    message = (
        f"[minippo] {_rank_label()} (pid {os.getpid()}): the SGLang engine died (SIGQUIT from its "
        f"scheduler or subprocess watchdog); {'; '.join(reports)}. The scheduler's traceback "
        "('Scheduler hit an exception: ...') is in this process's stderr just above, unless a "
        "child was killed from outside (exit code -9: check `dmesg -T | grep -i oom`). This rank "
        f"stops: it exits with code {DEATH_EXIT_CODE} in {DEATH_EXIT_GRACE_S:.0f} s at the latest."
    )
    print(message, file=sys.stderr, flush=True)
    for engine in engines:
        engine._mark_dead(message)
    timer = threading.Timer(DEATH_EXIT_GRACE_S, _hard_exit)
    timer.daemon = True
    timer.start()
    raise SGLangEngineDied(message)


def _hard_exit() -> None:
    print(
        f"[minippo] {_rank_label()}: still alive {DEATH_EXIT_GRACE_S:.0f} s after its SGLang engine "
        f"died; exiting with code {DEATH_EXIT_CODE}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(DEATH_EXIT_CODE)


@contextlib.contextmanager
def engine_launch_environment(
    environ: MutableMapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """The environment SGLang's child processes are spawned with (they copy ``os.environ``), and
    in which its ``Engine()`` reads its settings; everything is restored afterwards.

    * Removes ``TORCHELASTIC_USE_AGENT_STORE``: under torchrun every worker has it, and a scheduler
      that inherits it and calls ``init_process_group(init_method="tcp://127.0.0.1:<nccl_port>")``
      waits, with torch < 2.14.1, as a client of a store that nobody serves (>= 10 minutes).
    * Sets ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``: the backend passes SGLang a context a
      few tokens longer than the model config's (``CONTEXT_SLACK``), which SGLang refuses otherwise.
    * Sets ``extra`` (e.g. :func:`cpu_launch_environment`'s thread count of a CPU engine).
    """
    env = os.environ if environ is None else environ
    saved = {key: env.get(key) for key in (AGENT_STORE_ENV, CONTEXT_OVERRIDE_ENV, *(extra or {}))}
    env.pop(AGENT_STORE_ENV, None)
    env[CONTEXT_OVERRIDE_ENV] = "1"
    env.update(extra or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value


# What SGLang's modules warn at import on a machine without its GPU kernels (AWQ, GGUF and Triton
# "only on CUDA"): true of every CPU engine, repeated by each of its processes, and nothing a user
# can act on. The start of each message (warnings filters match a message's start).
GPU_KERNEL_IMPORT_WARNINGS = ("Only CUDA, ", "Triton is not supported on current platform")


@contextlib.contextmanager
def gpu_kernel_import_warnings_ignored() -> Iterator[None]:
    """Import SGLang in this process without :data:`GPU_KERNEL_IMPORT_WARNINGS`; other warnings,
    and these anywhere else, are kept."""
    with warnings.catch_warnings():
        for start in GPU_KERNEL_IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(start), category=UserWarning)
        yield


def cpu_launch_environment(cpu_threads: int | None) -> dict[str, str]:
    """The variables a CPU engine's processes start with: ``OMP_NUM_THREADS`` = ``cpu_threads``
    (None: half this process's cores over the ranks of this node, at least 1; the trainer takes
    the other half, ``cpu_threads`` of the recipe), and ``PYTHONWARNINGS`` with the user's own
    filters plus an ``ignore`` of each of :data:`GPU_KERNEL_IMPORT_WARNINGS`."""
    if cpu_threads is None:
        from minippo.engine.torch_engine import default_num_threads

        cpu_threads = default_num_threads()
    filters = [f"ignore:{start}:UserWarning" for start in GPU_KERNEL_IMPORT_WARNINGS]
    if os.environ.get("PYTHONWARNINGS"):
        filters.insert(0, os.environ["PYTHONWARNINGS"])  # later entries take precedence
    return {"OMP_NUM_THREADS": str(int(cpu_threads)), "PYTHONWARNINGS": ",".join(filters)}


def use_device(device: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Set, before SGLang is imported, how SGLang finds its device; refuse what cannot work.

    SGLang reads ``SGLANG_USE_CPU_ENGINE`` when its modules are imported (module-level flags), so
    for ``device="cpu"`` it is set here for the whole process (the engine's children inherit it),
    and an SGLang imported earlier without it is refused. On the CPU SGLang imports a module named
    ``sgl_kernel`` that the CUDA wheel on PyPI cannot provide: the one
    ``scripts/sglang_cpu_env.sh`` installs must be importable. ``device="cuda"`` refuses
    ``SGLANG_USE_CPU_ENGINE=1``.
    """
    env = os.environ if environ is None else environ
    flag = env.get(CPU_ENGINE_ENV, "0")
    if device == "cuda":
        if flag == "1":
            raise RuntimeError(
                f"{CPU_ENGINE_ENV}=1 is set, but engine.device=cuda: SGLang would run on the CPU; "
                f"unset {CPU_ENGINE_ENV} or set engine.device=cpu"
            )
        return
    if flag != "1" and any(name.startswith("sglang.srt") for name in sys.modules):
        raise RuntimeError(
            "SGLang was imported in this process before engine.device=cpu set "
            f"{CPU_ENGINE_ENV}=1 (it reads it at import): build the CPU engine before importing "
            f"sglang, or export {CPU_ENGINE_ENV}=1"
        )
    env[CPU_ENGINE_ENV] = "1"
    try:
        import sgl_kernel

        ours = hasattr(sgl_kernel, "assign_req_to_token_pool_cpu")
    except (ImportError, OSError):
        ours = False
    if not ours:
        raise RuntimeError(
            "engine.device=cpu needs the pure-torch `sgl_kernel` module that SGLang's CPU path "
            "imports (the sglang-kernel wheel is a CUDA build): build the environment with "
            "`bash scripts/sglang_cpu_env.sh VENV_DIR` and run with VENV_DIR/bin/minippo"
        )


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """Keep this process's logging set-up across the block: SGLang's ``Engine()`` calls
    ``logging.basicConfig(level=ERROR, force=True)`` in the trainer's process
    (``configure_logger``), which would drop minippo's handlers and hide its warnings."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse environment settings that break the engine or change its logprobs.

    * ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` (torch reads
      both): the engine inherits it, and SGLang's memory pools and release/resume
      (torch_memory_saver) do not work with expandable segments.
    * ``SGLANG_RETURN_ORIGINAL_LOGPROB`` true: SGLang would return T = 1 logprobs instead of
      ``log_softmax(logits / T)``.
    """
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = environ.get(var, "")
        if "expandable_segments" in conf:
            raise RuntimeError(
                f"{var}={conf!r} contains expandable_segments, which the SGLang engine inherits "
                "and does not support; unset it (or drop expandable_segments) before building "
                "SGLangEngine"
            )
    flag = environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")
    if flag.strip().lower() in ("1", "true", "yes", "on"):
        raise RuntimeError(
            f"SGLANG_RETURN_ORIGINAL_LOGPROB={flag!r} makes SGLang return temperature-1 "
            "logprobs, but minippo's logprob is log_softmax(logits / T); unset it"
        )


# ----------------------------------------------------------------------------------------------
# Published weight names and shapes


def expected_hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """``{HF name: shape}`` of every weight a publish of a model with ``args`` carries.

    Built on the meta device (no memory); the names are those ``minippo.parallel.
    full_tensor_buckets`` gives (``minippo.models.hf_name`` of the native names; a tied lm_head is
    the embedding and is not listed).
    """
    import torch

    from minippo.models import Transformer, hf_name

    with torch.device("meta"):
        model = Transformer(args)
    return {hf_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def _listed(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def shape_mismatches(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """Human-readable differences between two ``{HF name: shape}`` maps (empty when equal)."""
    out = []
    unknown = [n for n in got if n not in expected]
    missing = [n for n in expected if n not in got]
    wrong = [
        f"{n} {tuple(got[n])} vs {tuple(expected[n])}"
        for n in got
        if n in expected and tuple(got[n]) != tuple(expected[n])
    ]
    if unknown:
        out.append(f"not in the engine's model: {_listed(unknown)}")
    if missing:
        out.append(f"never published (would keep the engine's dummy weights): {_listed(missing)}")
    if wrong:
        out.append(f"shape (published vs engine): {_listed(wrong)}")
    return out
