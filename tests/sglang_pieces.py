"""SGLang's own serialization code on a machine without SGLang (a GPU box where its kernels are
absent, for scripts/gpu_rehearsal.py).

The pinned wheel (downloaded by pip, cached under ~/.cache/minippo/wheels or $MINIPPO_CACHE/wheels)
is read, never installed; nothing of SGLang is copied into this repository.
``serialization_pieces(wheel)`` executes, from the wheel's source, exactly the definitions the
weight path needs: ``MultiprocessingSerializer``, ``SafeUnpickler`` (with its allow-list) and
``_safe_load_torch_storage`` from ``sglang/srt/utils/common.py``, and the producer/consumer
reduction patch from ``sglang/srt/utils/patch_torch.py``. With ``register=True`` they are also
installed as ``sys.modules["sglang.srt.utils.patch_torch"]``, so that ``SafeUnpickler`` resolves a
payload made with the patch, as in the scheduler. ``digest_server`` is the spawned consumer.

Where SGLang is installed (the environment of scripts/sglang_cpu_env.sh), the ``sglang_cpu`` lane
(tests/sglang_cpu/) runs the real modules and the real engine instead."""

from __future__ import annotations

import ast
import hashlib
import io
import os
import subprocess
import sys
import time
import types
import typing
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SGLANG_VERSION = "0.5.23"
ROOT = Path(__file__).resolve().parents[1]
# the request structs the backend builds, and the base they derive from (the sglang_cpu lane
# checks that the backend builds the real ones)
STRUCTS = (
    "BaseReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "BeginWeightUpdateReqInput",
    "EndWeightUpdateReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightVersionReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "FlushCacheReqOutput",
)


def cache_dir() -> Path:
    root = os.environ.get("MINIPPO_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "minippo") / "wheels"


def find_wheel() -> Path | None:
    found = sorted(cache_dir().glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[0] if found else None


def download_wheel() -> Path:
    """The cached pinned wheel, downloading it on first use (RuntimeError with pip's words)."""
    found = find_wheel()
    if found:
        return found
    cache_dir().mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"sglang=={SGLANG_VERSION}", "-d", str(cache_dir()),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot download sglang=={SGLANG_VERSION}: {e}") from None
    found = find_wheel()
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"cannot download sglang=={SGLANG_VERSION} with `{' '.join(cmd)}` (offline, or no "
            f"wheel for this platform): {' | '.join(tail)}"
        )
    return found


# ----------------------------------------------------------------------------------------------
# Definitions executed from the wheel's source (no dependency beyond torch)


def _source(wheel: Path, module: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(module.replace(".", "/") + ".py").decode("utf-8")


def exec_definitions(source: str, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
    """Execute the top-level definitions (def, class, assignment) named ``names`` of ``source``,
    in source order, into ``namespace``; raise LookupError for a name that is not defined."""
    tree = ast.parse(source)
    picked, found = [], set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined = {node.name}
        elif isinstance(node, ast.Assign):
            defined = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined = {node.target.id}
        else:
            continue
        if defined & set(names):
            picked.append(node)
            found |= defined
    missing = set(names) - found
    if missing:
        raise LookupError(f"not defined at the top level of the source: {sorted(missing)}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), "<sglang>", "exec"), namespace)


def serialization_pieces(wheel: Path, *, register: bool = False) -> SimpleNamespace:
    """SGLang's weight-payload code from ``wheel`` (see the module docstring).

    Returns ``SimpleNamespace(MultiprocessingSerializer, SafeUnpickler, allowed_globals,
    monkey_patch_torch_reductions)``; ``MultiprocessingSerializer`` handles bytes payloads (the
    base64 string form would need pybase64, which is not loaded here).
    """
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    common: dict[str, Any] = {
        "__name__": "sglang.srt.utils.common",
        "io": io,
        "pickle": pickle,
        "torch": torch,
        "ForkingPickler": ForkingPickler,
    }
    exec_definitions(
        _source(wheel, "sglang.srt.utils.common"),
        ("MultiprocessingSerializer", "_safe_load_torch_storage", "SafeUnpickler"),
        common,
    )
    patch = types.ModuleType("sglang.srt.utils.patch_torch")
    # the names patch_torch.py imports (its sglang import only serves the NPU branch)
    patch.__dict__.update(
        torch=torch, reductions=reductions, _is_npu=False, Callable=Callable, Union=typing.Union
    )
    exec_definitions(
        _source(wheel, "sglang.srt.utils.patch_torch"),
        (
            "monkey_patch_torch_reductions",
            "_REDUCE_TENSOR_ARG_DEVICE_INDEX",
            "_reduce_tensor_modified",
            "_rebuild_cuda_tensor_modified",
            "_device_to_uuid",
            "_device_from_maybe_uuid",
            "_modify_tuple",
        ),
        patch.__dict__,
    )
    if register:  # SafeUnpickler imports the patched rebuild function by module name
        for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["sglang.srt.utils.patch_torch"] = patch
    unpickler = common["SafeUnpickler"]
    return SimpleNamespace(
        MultiprocessingSerializer=common["MultiprocessingSerializer"],
        SafeUnpickler=unpickler,
        allowed_globals=frozenset(unpickler.ALLOWED_GLOBALS),
        monkey_patch_torch_reductions=patch.monkey_patch_torch_reductions,
    )


def tensor_digests(named: list[tuple[str, Any]]) -> list[tuple[str, str, str, list[int]]]:
    """``(name, dtype, sha256 of the raw bytes, shape)`` per tensor: a bit-exact fingerprint."""
    out = []
    for name, t in named:
        raw = t.detach().contiguous().cpu().reshape(-1).view(dtype=__import__("torch").uint8)
        digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        out.append((name, str(t.dtype), digest, list(t.shape)))
    return out


def digest_server(wheel: str, conn: Any) -> None:
    """Spawned-process target (scripts/gpu_rehearsal.py): load SGLang's pieces, then for each
    payload received, unpickle it with SGLang's SafeUnpickler (as the scheduler's
    ``MultiprocessingSerializer.deserialize`` does) and answer its digests and the rebuild time;
    stop on None. Errors are answered, not raised."""
    try:
        pieces = serialization_pieces(Path(wheel), register=True)
    except BaseException as e:
        conn.send({"error": f"loading SGLang's code from {wheel}: {type(e).__name__}: {e}"})
        return
    while True:
        payload = conn.recv()
        if payload is None:
            break
        try:
            t0 = time.perf_counter()
            named = pieces.MultiprocessingSerializer.deserialize(payload)
            rebuild_s = time.perf_counter() - t0
            conn.send({"digests": tensor_digests(named), "rebuild_s": rebuild_s})
            del named
        except BaseException as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})
    conn.close()


# ----------------------------------------------------------------------------------------------
# Real imports in a child process (side folder)
