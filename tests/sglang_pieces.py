"""SGLang's own code on a machine without SGLang (CPU, or a GPU box where its kernels are absent).

The pinned wheel (downloaded by pip, cached under ~/.cache/minippo/wheels or $MINIPPO_CACHE/wheels)
is used two ways; nothing of SGLang is copied into this repository.

* ``serialization_pieces(wheel)``: no dependency beyond torch. Executes, from the wheel's source,
  exactly the definitions the weight path needs: ``MultiprocessingSerializer``, ``SafeUnpickler``
  (with its allow-list) and ``_safe_load_torch_storage`` from ``sglang/srt/utils/common.py``, and
  the producer/consumer reduction patch from ``sglang/srt/utils/patch_torch.py``. With
  ``register=True`` they are also installed as ``sys.modules["sglang.srt.utils.patch_torch"]``, so
  that ``SafeUnpickler`` resolves a payload made with the patch, as in the scheduler. For
  scripts/gpu_rehearsal.py and its spawned unpickling process (``digest_server``).
* A side folder (``side_folder()``): the wheel's ``sglang/`` tree plus the pure-Python (or
  binary-wheel, dependency-free) packages its modules import (``SIDE_DEPS``, pip ``--target``),
  used by a child process (``run_real``, ``python -m tests.sglang_pieces``) that really imports
  the modules: ``sglang/__init__.py`` is bypassed (it imports the whole frontend), and the GPU
  compiler ``triton``, which ``sglang.srt.utils.common`` imports but does not use at import, is
  an empty placeholder module while those modules import (torch's own triton probe runs first,
  so torch never sees it).

What imports that way on CPU (sglang 0.5.23, torch 2.13): ``sglang.srt.sampling.sampling_params``,
``sglang.srt.utils.common`` (with the placeholder), ``sglang.srt.utils.patch_torch``,
``sglang.srt.utils.msgspec_utils``. What does not: ``sglang.srt.managers.io_struct`` (it imports
``schedule_batch``, which imports every model config and multimodal processor, down to
torchvision's compiled operators and transformers processors). The request structs are therefore
built by executing their class definitions from io_struct's source, over the really imported
``msgspec`` and ``msgspec_utils`` (``request_structs``).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
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
# what sglang.srt.utils.common and sampling_params import beyond this project's own dependencies
SIDE_DEPS = ("msgspec", "pybase64", "psutil", "pyzmq", "starlette", "prometheus_client")
# the request structs the backend builds, and the base they derive from
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


def side_folder() -> Path:
    """The wheel's sglang/ tree plus SIDE_DEPS, cached next to the wheel (RuntimeError when the
    wheel or the packages cannot be fetched)."""
    wheel = download_wheel()
    side = cache_dir() / f"sglang-{SGLANG_VERSION}-side"
    done = side / ".complete"
    if done.exists():
        return side
    side.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.startswith("sglang/") and m.endswith(".py")]
        z.extractall(side, members)
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
        "--target", str(side), *SIDE_DEPS,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"cannot install {SIDE_DEPS} into {side}: {' | '.join(tail)}")
    done.write_text(json.dumps({"deps": SIDE_DEPS, "at": time.time()}))
    return side


def run_real(check: str, *, timeout: float = 300.0) -> dict[str, Any]:
    """Run ``check`` of this module's child entry point with the side folder; its JSON report."""
    side = side_folder()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(side)])}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang_pieces", check, str(side), str(find_wheel())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{check} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("REPORT "))


def _setup_real_imports(side: Path) -> None:
    """In the child: the sglang package without its __init__, and the triton placeholder."""
    import torch._dynamo  # noqa: F401  (torch probes for triton first, and caches "absent")

    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(side / "sglang")]
    sys.modules["sglang"] = pkg


def _import(name: str) -> tuple[Any, str]:
    import importlib

    placeholder = "triton" not in sys.modules
    if placeholder:
        sys.modules["triton"] = types.ModuleType("triton")
    try:
        return importlib.import_module(name), "imported"
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        if placeholder:
            sys.modules.pop("triton", None)


def request_structs(io_struct_source: str) -> dict[str, type]:
    """The backend's request structs, executed from io_struct's source over the really imported
    msgspec and sglang.srt.utils.msgspec_utils."""
    import msgspec
    from sglang.srt.utils import msgspec_utils

    ns: dict[str, Any] = {"__name__": "sglang.srt.managers.io_struct", "msgspec": msgspec}
    ns.update({k: getattr(typing, k) for k in ("Optional", "List", "Literal", "Annotated")})
    ns.update({k: getattr(msgspec_utils, k) for k in dir(msgspec_utils) if not k.startswith("_")})
    exec_definitions(io_struct_source, STRUCTS, ns)
    return {k: ns[k] for k in STRUCTS}


def _child(check: str, side: Path, wheel: Path) -> dict[str, Any]:
    _setup_real_imports(side)
    modules = (
        "sglang.srt.sampling.sampling_params",
        "sglang.srt.utils.msgspec_utils",
        "sglang.srt.utils.common",
        "sglang.srt.utils.patch_torch",
        "sglang.srt.managers.io_struct",
    )
    imported = {}
    for name in modules:
        imported[name] = _import(name)[1]
    report: dict[str, Any] = {"imports": imported}
    if check == "imports":
        return report
    if check == "sampling":
        return {**report, "sampling": _check_sampling()}
    if check == "weights":
        return {**report, "weights": _check_weights(wheel)}
    if check == "backend":
        return {**report, "backend": _check_backend(wheel)}
    if check == "all":
        return {
            **report,
            "sampling": _check_sampling(),
            "backend": _check_backend(wheel),  # before _check_weights applies SGLang's patch
            "weights": _check_weights(wheel),
        }
    raise ValueError(f"unknown check {check!r}")


def _check_sampling() -> list[dict[str, Any]]:
    """Our sampling dicts through SGLang's own SamplingParams (construction, defaults, verify)."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

    from minippo.engine import SamplingParams as Ours
    from minippo.engine.sglang_engine import sglang_sampling_params

    cases = [
        Ours(),
        Ours(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9, stop_token_ids=(2, 3), seed=7),
        Ours(temperature=0.0, seed=3, max_new_tokens=4),
    ]
    out = []
    for ours in cases:
        for send_seed in (True, False):
            sp = SamplingParams(**sglang_sampling_params(ours, send_seed=send_seed))
            sp.verify(vocab_size=1000)
            out.append(
                {
                    "temperature": sp.temperature,
                    "top_k": sp.top_k,
                    "top_k_is_all": sp.top_k == TOP_K_ALL,
                    "top_p": sp.top_p,
                    "max_new_tokens": sp.max_new_tokens,
                    "stop_token_ids": sorted(sp.stop_token_ids or []),
                    "ignore_eos": sp.ignore_eos,
                    "sampling_seed": sp.sampling_seed,
                    "send_seed": send_seed,
                    "ours": ours.__dict__ | {"stop_token_ids": list(ours.stop_token_ids)},
                }
            )
    return out


def _check_weights(wheel: Path) -> dict[str, Any]:
    """Our payload (serialize_bucket's serializer) unpickled by SGLang's really imported
    SafeUnpickler in a spawned process; and what the real producer-side patch does."""
    import multiprocessing
    import pickle

    import torch
    from sglang.srt.utils import patch_torch
    from sglang.srt.utils.common import MultiprocessingSerializer, SafeUnpickler
    from torch.multiprocessing import reductions

    from minippo.models import Transformer, init_weights, qwen3_tiny
    from minippo.parallel import full_tensor_buckets

    model = init_weights(Transformer(qwen3_tiny()), seed=1, std=0.1)
    named = [x for b in full_tensor_buckets(model, bucket_bytes=1 << 30, dtype=torch.bfloat16)
             for x in b]  # fmt: skip
    payload = MultiprocessingSerializer.serialize(obj=named)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_spawned_real_unpickle, args=(payload, there, sys.path[:]))
    proc.start()
    got = here.recv() if here.poll(120) else {"error": "no answer in 120 s"}
    proc.join(30)
    report = {
        "n_tensors": len(named),
        "spawned": got,
        "digests": tensor_digests(named),
        "rebuild_cuda_tensor_modified_allowed": (
            "sglang.srt.utils.patch_torch",
            "_rebuild_cuda_tensor_modified",
        )
        in SafeUnpickler.ALLOWED_GLOBALS,
        "rebuild_cuda_tensor_allowed": ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
        in SafeUnpickler.ALLOWED_GLOBALS,
    }
    try:  # a global of a code module is refused
        MultiprocessingSerializer.deserialize(pickle.dumps(os.system))
        report["blocks_os_system"] = False
    except RuntimeError as e:
        report["blocks_os_system"] = "Blocked unsafe global" in str(e)
    patch_torch.monkey_patch_torch_reductions()
    report["patched_reduce_tensor"] = reductions.reduce_tensor.__name__
    try:
        MultiprocessingSerializer.serialize(obj=named[:1])
        report["patched_cpu_serialize"] = "ok"
    except Exception as e:
        report["patched_cpu_serialize"] = f"{type(e).__name__}: {e}"
    return report


def _spawned_real_unpickle(payload: bytes, conn: Any, path: list[str]) -> None:
    sys.path[:] = path
    try:
        side = Path(next(p for p in path if p.endswith(f"sglang-{SGLANG_VERSION}-side")))
        _setup_real_imports(side)
        mod, status = _import("sglang.srt.utils.common")
        if mod is None:
            raise ImportError(status)
        named = mod.MultiprocessingSerializer.deserialize(payload)
        conn.send({"digests": tensor_digests(named), "unpickler": mod.SafeUnpickler.__module__})
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _check_backend(wheel: Path) -> dict[str, Any]:
    """The backend against the recording stand-in, with SGLang's real request structs and its
    real MultiprocessingSerializer / SafeUnpickler in place of the stand-in's."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    import tests.unit.test_sglang_engine as stand_in

    structs = request_structs(_source(wheel, "sglang.srt.managers.io_struct"))
    return stand_in.run_with_real_pieces(structs, MultiprocessingSerializer)


if __name__ == "__main__":
    check, side_arg, wheel_arg = sys.argv[1:4]
    result = _child(check, Path(side_arg), Path(wheel_arg))
    print("REPORT " + json.dumps(result, default=str), flush=True)
