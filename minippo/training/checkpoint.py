"""Atomic, sharded training checkpoints (torch.distributed.checkpoint).

Layout under ``ckpt_dir`` (``${output_dir}/checkpoints`` in the configs)::

    step_000010/              a complete checkpoint: 10 training steps done
        .metadata, *.distcp   DCP shards of every model and optimizer (each rank writes its own)
        extra_rank0.pt        per-rank state of the Stateful components (torch.save): RNG, correction,
        extra_rank1.pt        rollout queue (with the batch generated ahead), LR schedulers, guards
        meta.json             {"step": 10, "world_size": 2, "shard_ranks": 2, "format": 2, ...};
                              written last
    latest                    one line: the name of the newest complete checkpoint

Atomicity: everything is written into ``step_000010.tmp/``; only when every rank has finished,
rank 0 writes ``meta.json``, renames the folder to ``step_000010`` (an atomic ``os.rename``) and
then replaces ``latest`` (write ``latest.tmp``, ``os.replace``). A process killed at any point of a
save therefore leaves the previous checkpoint and the ``latest`` pointer intact; the next save
removes the half-written ``.tmp`` folder.

Several nodes (docs/multinode.md): ``shared=True`` (``parallel.shared_output_dir``, the default)
means ``ckpt_dir`` is one folder every node sees, and rank 0 alone manages it as above; a save
whose ``.tmp`` folder some rank cannot see stops with the fix. ``shared=False`` means each node
has its own disk: the first rank of every node (``LOCAL_RANK`` 0) manages the folder on its node,
which then holds its ranks' shards, their ``extra_rank*.pt`` and a ``meta.json``; the DCP
``.metadata`` is on rank 0's node only. Resuming such a checkpoint needs every node's step folder
copied into one folder that every rank reads (:func:`verify_checkpoint` names a missing file).

Models and optimizers go through ``get_state_dict`` / ``set_state_dict``
(``torch.distributed.checkpoint.state_dict``), so the same code saves a plain module in a single
process (no process group) and an FSDP2-sharded module on N ranks (each rank writes its shards),
FSDP over all ranks or HSDP across nodes. DCP reshards on load: :meth:`Checkpointer.load_models`
loads the models and optimizers of a checkpoint into any layout (another mesh, another number of
ranks, one process). A full resume (:meth:`Checkpointer.load`) needs the same world size and the
same ``shard_ranks`` (how many ranks one parameter is split over, recorded in ``meta.json``):
the per-rank extra state holds RNG states and local weight shards (the corrections' copies).

Everything else is a ``Stateful`` (torchtitan's pattern): any object with ``state_dict()`` and
``load_state_dict(state)``, passed by name as ``states={"queue": queue, "rng": RNGState(), ...}``;
the checkpointer saves each one's ``state_dict()`` and, on load, hands it back to the object of
the same name. ``meta.json`` records ``format`` (:data:`CHECKPOINT_FORMAT`); a checkpoint of
another format is refused with a message that names it.

Damage: :func:`verify_checkpoint` checks a checkpoint's files without loading them (meta.json,
the DCP ``.metadata``, every ``.distcp`` at least as long as the metadata says, every
``extra_rank*.pt`` a complete archive); a damaged one is refused with the file, what is wrong and
the newest intact checkpoint to resume from instead. A save that fails (a full disk, for one)
removes its partial ``.tmp`` folder and says so; the previous checkpoint and ``latest`` stay.

Data, not code: ``extra_rank*.pt`` is loaded with ``torch.load(weights_only=True)``, which builds
tensors, Python's containers and scalars and the classes :func:`checkpoint_state_types` lists,
and refuses any other global a pickle names (a checkpoint from elsewhere cannot run code on
resume): :class:`UnsafeCheckpointError`, one line naming the file and the global.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from minippo.parallel.distributed import collective_device

log = logging.getLogger(__name__)

LATEST = "latest"
# Version of the checkpoint layout. 1: a hand-written "extra" dict (no "format" in meta.json);
# 2: one entry per named Stateful component.
CHECKPOINT_FORMAT = 2


@runtime_checkable
class Stateful(Protocol):
    """What the checkpointer saves besides models and optimizers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world_size() -> int:
    return dist.get_world_size() if _dist() else 1


def _node_leader() -> bool:
    """Whether this process is the first rank of its node (``LOCAL_RANK`` 0; a single process
    is)."""
    return int(os.environ.get("LOCAL_RANK", _rank())) == 0


def shard_ranks_of(models: Mapping[str, tuple[nn.Module, Any]]) -> int:
    """How many ranks one parameter of ``models`` is split over: the product of the mesh
    dimensions an FSDP2 (DTensor) parameter is sharded on (HSDP: the shard dimension, not the
    replicas); 1 for plain modules."""
    for model, _ in models.values():
        for p in model.parameters():
            placements = getattr(p, "placements", None)
            if placements is None:
                return 1
            mesh = p.device_mesh
            return math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())
    return 1


def _appears(folder: Path, wait_s: float = 10.0) -> bool:
    """Whether ``folder`` is (or within ``wait_s`` becomes) visible here: a network file system
    may show another node's new folder only after its cached listing of the parent expires."""
    deadline = time.monotonic() + wait_s
    while not folder.is_dir():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            os.listdir(folder.parent)  # a fresh listing, where the client caches lookups
    return True


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    """``step_000010`` for step 10 (zero-padded so that names sort by step)."""
    return f"step_{step:06d}"


def capture_rng_state() -> dict[str, Any]:
    """The RNG states this process uses: Python ``random``, torch CPU and (if present) CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng_state`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """This process's RNG states as a Stateful (:func:`capture_rng_state` / :func:`restore_rng_state`)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)


class Checkpointer:
    """Save and load training checkpoints under ``ckpt_dir``; see the module docstring.

    Args:
        ckpt_dir: the folder holding ``step_*`` checkpoints and the ``latest`` pointer.
        keep_last: keep only the newest ``keep_last`` checkpoints (None: keep all).
        shared: ``ckpt_dir`` is one folder that every node sees (rank 0 manages it); False: a
            folder on each node's own disk, managed by the node's first rank (module docstring).
    """

    # how long a rank waits for rank 0's new folder to appear on a shared (network) file system
    visibility_wait_s = 10.0

    def __init__(
        self, ckpt_dir: str | os.PathLike, *, keep_last: int | None = None, shared: bool = True
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(
                f"checkpoint.keep_last must be an integer >= 1 or null (keep all), got {keep_last!r}"
            )
        self.ckpt_dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.shared = shared

    def _manages_folder(self) -> bool:
        """Rank 0 on a shared folder; the first rank of each node on node-local folders."""
        return _rank() == 0 if self.shared else _node_leader()

    # ---------------------------------------------------------------- save
    def save(
        self,
        step: int,
        *,
        models: Mapping[str, tuple[nn.Module, torch.optim.Optimizer | None]],
        states: Mapping[str, Stateful],
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically; collective (call on every rank); returns its path.

        Args:
            step: number of completed training steps (a resumed run starts at this step).
            models: name -> (module, its optimizer or None). Saved as DCP shards under the keys
                ``name`` and ``name + "_optim"``.
            states: name -> Stateful (queue, correction, schedulers, guards, RNG...); each one's
                ``state_dict()`` must be picklable, with plain tensors (a rank's local shards),
                not DTensors. Saved per rank.
            meta: small JSON-able facts added to ``meta.json`` (e.g. the weight version).
        """
        final = self.ckpt_dir / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        owner = tmp / ".owner"  # which rank created the folder: tells shared from node-local
        if self._manages_folder():
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left over by a save that was killed
                shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(exist_ok=True)
            owner.write_text(str(_rank()))
        _barrier()
        self._check_sharing(tmp, owner)

        state = _model_state(models)
        extra = {name: obj.state_dict() for name, obj in states.items()}
        error: BaseException | None = None
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not _dist())
            torch.save(extra, tmp / f"extra_rank{_rank()}.pt")
        except (Exception, CheckpointException) as e:  # a full disk, for one
            error = e
        if not _all_ranks_ok(error is None):
            self._failed_save(step, tmp, error)

        if self._manages_folder():
            owner.unlink(missing_ok=True)
            info = {
                "step": step,
                "world_size": _world_size(),
                "shard_ranks": shard_ranks_of(models),
                "format": CHECKPOINT_FORMAT,
                "time": time.time(),
            }
            if not self.shared:
                info["output_dir_shared"] = False
            info.update(meta or {})
            _write_text_atomic(tmp / "meta.json", json.dumps(info, indent=2) + "\n")
            old = None
            if final.exists():  # the same step saved by an earlier run in this folder
                old = final.with_name(f"{final.name}.old-{os.getpid()}")
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(self.ckpt_dir)
            _write_text_atomic(self.ckpt_dir / LATEST, final.name + "\n")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()
        _barrier()
        return final

    def _check_sharing(self, tmp: Path, owner: Path) -> None:
        """Stop (on every rank) when ``shared`` does not describe the folder: a rank that does not
        see the folder rank 0 created (node-local disks declared shared), or a node whose folder
        another node's first rank created (a shared folder declared node-local)."""
        if self.shared:
            ok = _appears(tmp, self.visibility_wait_s)
        else:
            try:
                ok = not self._manages_folder() or owner.read_text() == str(_rank())
            except OSError:
                ok = False
        if _all_ranks_ok(ok):
            return
        if self.shared:
            why = (
                "is not one folder shared by every node (a rank does not see the folder rank 0 "
                "created); put output_dir on a file system that every node mounts, or set "
                "parallel.shared_output_dir=false (each node keeps its ranks' shards)"
            )
        else:
            why = (
                "is one folder shared by several nodes, but parallel.shared_output_dir=false "
                "says each node has its own; set parallel.shared_output_dir=true"
            )
        raise OSError(f"checkpoint.dir={self.ckpt_dir} {why} (docs/multinode.md)")

    def _failed_save(self, step: int, tmp: Path, error: BaseException | None) -> None:
        """Remove the partial checkpoint (rank 0; each node's first rank on node-local folders)
        and raise a message that says why, where, and that the previous checkpoint is intact."""
        if self._manages_folder():
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        latest = self.ckpt_dir / LATEST
        previous = latest.read_text().strip() if latest.is_file() else None
        kept = (
            f"the previous checkpoint {self.ckpt_dir / previous} is intact (resume_from=latest)"
            if previous
            else "no earlier checkpoint exists"
        )
        where = f"checkpoint {step_dir_name(step)} could not be written to {self.ckpt_dir}"
        fix = ""
        if error is None:
            why = "another rank failed to write its part"
        elif _disk_full(error):
            free = shutil.disk_usage(self.ckpt_dir).free / 2**20
            why = f"no space left on device ({free:.1f} MiB free)"
            fix = "; free some space or set checkpoint.dir to another disk"
        else:
            why = f"{type(error).__name__}: {_last_line(error)}"
        raise OSError(
            f"{where}: {why}; the partial checkpoint was removed and {kept}{fix}"
        ) from error

    def _prune(self) -> None:
        """Delete the oldest complete checkpoints beyond ``keep_last``, by step; never the one
        ``latest`` names (so ``latest`` never points to a deleted checkpoint)."""
        if self.keep_last is None:
            return
        latest = (self.ckpt_dir / LATEST).read_text().strip()
        done = sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir() and p.suffix == "")
        for p in done[: -self.keep_last]:
            if p.name != latest:
                shutil.rmtree(p, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def resolve(
        self, resume_from: str | os.PathLike | None, key: str = "resume_from"
    ) -> Path | None:
        """The checkpoint folder that ``resume_from`` names, or None for a fresh run.

        ``resume_from``: None / "" / "null" (fresh run), ``"latest"`` (what ``ckpt_dir/latest``
        points to), or a path: a ``step_*`` folder, or a checkpoint root with a ``latest`` file.
        ``key``: the config key the value came from, named in the errors.
        """
        if resume_from is None or str(resume_from) in ("", "null", "None"):
            return None
        if str(resume_from) == LATEST:
            root = self.ckpt_dir
            if not (root / LATEST).is_file():
                raise FileNotFoundError(
                    f"resume_from=latest, but {root / LATEST} does not exist (no checkpoint was "
                    f"saved in {root}); set resume_from=null to start a fresh run, or "
                    "resume_from=<path to a step_* checkpoint folder>" + self._other_runs_hint()
                )
        else:
            root = Path(resume_from)
        if (root / LATEST).is_file():
            root = root / (root / LATEST).read_text().strip()
        if not (root / "meta.json").is_file():
            saved = self._saved_steps()
            example = f"e.g. {saved[-1]}" if saved else f"none is saved in {self.ckpt_dir} yet"
            raise FileNotFoundError(
                f"{key}={resume_from!s}: {root} is not a complete checkpoint (no meta.json); "
                f"give a step_* folder ({example})"
                + (" or 'latest'" if key == "resume_from" else " or the folder holding `latest`")
            )
        return root

    def _saved_steps(self) -> list[Path]:
        """The complete ``step_*`` folders of ``ckpt_dir``, oldest first."""
        found = self.ckpt_dir.glob("step_*") if self.ckpt_dir.is_dir() else []
        return sorted(p for p in found if p.suffix == "" and (p / "meta.json").is_file())

    def _other_runs_hint(self) -> str:
        """For ``<runs>/<run>/checkpoints`` without a checkpoint: the newest other run folder of
        ``<runs>`` that has one (the built-in configs start a new folder per launch)."""
        run = self.ckpt_dir.resolve().parent
        if self.ckpt_dir.name != "checkpoints" or not run.parent.is_dir():
            return ""
        others = [
            d
            for d in run.parent.iterdir()
            if d.is_dir()
            and not d.is_symlink()
            and d != run
            and (d / "checkpoints" / LATEST).is_file()
        ]
        if not others:
            return ""
        newest = max(others, key=lambda d: (d / "checkpoints" / LATEST).stat().st_mtime)
        return f"; to resume the run in {newest}: output_dir={newest} resume_from=latest"

    def load(
        self,
        path: str | os.PathLike,
        *,
        models: Mapping[str, tuple[nn.Module, torch.optim.Optimizer | None]],
        states: Mapping[str, Stateful],
    ) -> dict[str, Any]:
        """Load checkpoint ``path`` into ``models`` and ``states`` (in place); collective.

        Every name in ``states`` must be in the checkpoint. Returns the contents of meta.json.
        """
        path = Path(path)
        meta = self._read_format(path)
        if meta["world_size"] != _world_size():
            raise ValueError(
                f"checkpoint {path} was written by {meta['world_size']} ranks but this run has "
                f"{_world_size()}; resume with {layout_hint(meta)}"
            )
        saved, now = saved_shard_ranks(meta), shard_ranks_of(models)
        if saved != now:
            raise ValueError(
                f"checkpoint {path} was written with parameters split over {saved} ranks, this "
                f"run splits them over {now} (parallel.sharding or the ranks per node changed); "
                "its per-rank state (RNG, the corrections' weight shards) belongs to the saved "
                f"layout: resume with {layout_hint(meta)}, or load only its models and "
                "optimizers (Checkpointer.load_models)"
            )
        self.load_models(path, models=models, meta=meta)
        extra = load_extra_state(path / f"extra_rank{_rank()}.pt")
        missing = sorted(set(states) - set(extra))
        if missing:
            raise ValueError(
                f"checkpoint {path} has no state for {missing} (it holds {sorted(extra)}); it was "
                "written by a run with other components"
            )
        for name, obj in states.items():
            obj.load_state_dict(extra[name])
            _warn_if_schedule_changed(name, obj, meta["step"])
        log.info("loaded checkpoint %s (step %d)", path, meta["step"])
        return meta

    def load_models(
        self,
        path: str | os.PathLike,
        *,
        models: Mapping[str, tuple[nn.Module, torch.optim.Optimizer | None]],
        meta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load only the models and optimizers of checkpoint ``path`` (in place); collective.

        Any layout: DCP reads each rank's part of every tensor whatever mesh, number of ranks or
        sharding saved it (FSDP over 2 ranks, HSDP over 2 nodes x 1, one process). Per-rank
        states are not read. Returns the contents of meta.json.
        """
        path = Path(path)
        meta = meta or self._read_format(path)
        self.verify(path)  # every file complete, before any is read
        state = _model_state(models)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=not _dist())
        for name, (model, optim) in models.items():
            if optim is None:
                set_state_dict(model, [], model_state_dict=state[name], optim_state_dict={})
            else:
                set_state_dict(
                    model,
                    optim,
                    model_state_dict=state[name],
                    optim_state_dict=state[name + "_optim"],
                )
        return meta

    def _read_format(self, path: Path) -> dict[str, Any]:
        """meta.json of ``path``, refusing another checkpoint format."""
        meta = read_meta(path) or self.verify(path)  # a damaged meta.json: say which
        found = meta.get("format", 1)
        if found != CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint {path} has checkpoint format {found}, but this minippo reads format "
                f"{CHECKPOINT_FORMAT}; resume it with the minippo version that wrote it, or start "
                "a fresh run (resume_from=null)"
            )
        return meta

    def verify(self, path: str | os.PathLike) -> dict[str, Any]:
        """:func:`verify_checkpoint`, and when ``path`` is damaged, a message that also names the
        newest intact checkpoint of ``ckpt_dir`` to resume from instead. Returns meta.json."""
        path = Path(path)
        try:
            return verify_checkpoint(path)
        except CorruptCheckpointError as e:
            intact = self.newest_intact(exclude=path)
            hint = (
                f"resume from the previous intact checkpoint with resume_from={intact}"
                if intact is not None
                else "no intact checkpoint is left: start anew with resume_from=null "
                "overwrite_output_dir=true"
            )
            raise CorruptCheckpointError(f"{e}; {hint}") from None

    def newest_intact(self, exclude: Path | None = None) -> Path | None:
        """The complete ``step_*`` checkpoint with the highest step that passes
        :func:`verify_checkpoint` (None when there is none)."""
        done = sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir() and p.suffix == "")
        for p in reversed(done):
            if exclude is not None and p.resolve() == Path(exclude).resolve():
                continue
            try:
                verify_checkpoint(p)
            except CorruptCheckpointError:
                continue
            return p
        return None


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of checkpoint ``path`` (None when missing or unreadable)."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        return meta if isinstance(meta, dict) and "world_size" in meta and "step" in meta else None
    except (OSError, ValueError):
        return None


def saved_shard_ranks(meta: Mapping[str, Any]) -> int:
    """``shard_ranks`` of a checkpoint's meta.json; checkpoints from before the key were FSDP
    over all their ranks."""
    return int(meta.get("shard_ranks", meta["world_size"]))


def layout_hint(meta: Mapping[str, Any]) -> str:
    """The launch that gives a checkpoint's layout, for messages."""
    world, shard = int(meta["world_size"]), saved_shard_ranks(meta)
    if shard == world:
        return f"--nproc-per-node {world} (parallel.sharding=fsdp over {world} rank(s) in all)"
    return f"parallel.sharding=hsdp on {world // shard} node(s) x --nproc-per-node {shard}"


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or corrupt (the message names it)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint's per-rank state holds a type that is not data (a pickle that would import
    or call code): the message names the file and the type."""


def checkpoint_state_types() -> list[type | tuple[type, str]]:
    """The classes (besides tensors and Python's containers and scalars) that the per-rank
    ``extra_rank*.pt`` of a minippo checkpoint may hold: the rollout queues' batches, samples and
    carried groups (multi-turn episodes too), with the prompt items and completions inside them. :func:`load_extra_state`
    allows exactly these; a Stateful of your own whose ``state_dict()`` holds another class
    registers it with ``torch.serialization.add_safe_globals([YourClass])`` where it is defined
    (a plain dict of tensors and numbers needs nothing)."""
    from minippo.data.prompts import PromptExample
    from minippo.engine.protocol import Completion
    from minippo.rl.types import RolloutBatch
    from minippo.training.rollout_queue import QueueBatch, RolloutSample, _Episode, _Group, _Sample

    # the carried groups of an alternate-mode queue, under their module's earlier name too
    old = "minippo.training.alternating_queue"
    return [
        *(QueueBatch, RolloutSample, RolloutBatch, Completion, PromptExample, _Group, _Sample),
        _Episode,  # a carried multi-turn episode; its environment state is plain data or a
        # class its environment's module registers (docs/multi_turn.md)
        *((_Group, f"{old}._Group"), (_Sample, f"{old}._Sample")),
    ]


def load_extra_state(file: Path) -> dict[str, Any]:
    """One rank's ``extra_rank*.pt``, loaded as data (``torch.load(weights_only=True)``): tensors,
    containers, scalars and :func:`checkpoint_state_types`. A file whose pickle names any other
    global (a function to call, a class to build: code, not data) is refused with
    :class:`UnsafeCheckpointError` before anything in it runs."""
    try:
        with torch.serialization.safe_globals(checkpoint_state_types()):
            extra = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # the wording differs by torch version
        what = f"the global {found.group(1)}" if found else "an object that is not plain data"
        raise UnsafeCheckpointError(
            f"checkpoint {file.parent}: {file.name} holds {what}, which is not one of the types "
            "a minippo checkpoint holds (loading it could run code); it was not written by "
            "minippo's Checkpointer or was altered: resume from a checkpoint you trust, or, for "
            "a Stateful of your own, register its class with "
            "torch.serialization.add_safe_globals where the class is defined"
        ) from None
    if not isinstance(extra, dict):
        raise UnsafeCheckpointError(
            f"checkpoint {file.parent}: {file.name} holds a {type(extra).__name__}, not the dict "
            "of named states that Checkpointer.save writes"
        )
    return extra


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check the files of checkpoint ``path`` without loading any tensor; return its meta.json.

    Raises CorruptCheckpointError naming the file: meta.json missing or not JSON, the DCP
    ``.metadata`` unreadable, a ``.distcp`` shorter than its metadata says, an
    ``extra_rank<r>.pt`` of one of the ``world_size`` ranks missing or not a complete archive.
    """
    path = Path(path)

    node_local = False  # written to node-local disks: the other nodes' files are elsewhere

    def bad(file: str, what: str) -> CorruptCheckpointError:
        hint = ""
        if node_local and what == "missing":
            hint = (
                " (it was saved with parallel.shared_output_dir=false: copy the step folder of "
                "every node into one folder and resume from that; docs/multinode.md)"
            )
        return CorruptCheckpointError(f"checkpoint {path}: {file} is {what}{hint}")

    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        step, world_size = int(meta["step"]), int(meta["world_size"])
        node_local = meta.get("output_dir_shared") is False
    except FileNotFoundError:
        raise bad("meta.json", "missing (the save did not finish)") from None
    except (ValueError, KeyError, TypeError):
        raise bad("meta.json", "corrupt or truncated") from None
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except FileNotFoundError:
        raise bad(".metadata", "missing") from None
    except Exception:  # a truncated pickle raises any of several types
        raise bad(".metadata", "corrupt or truncated") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise bad(name, "missing")
        if file.stat().st_size < size:
            raise bad(name, f"truncated ({file.stat().st_size} of {size} bytes)")
    for rank in range(world_size):
        name = f"extra_rank{rank}.pt"
        if not (path / name).is_file():
            raise bad(name, "missing")
        if not _complete_zip(path / name):
            raise bad(name, "corrupt or truncated")
    meta["step"] = step
    return meta


def _complete_zip(file: Path) -> bool:
    """Whether ``file`` (torch.save's zip format) is a whole archive: its central directory reads
    and every member lies within the file (no data is read)."""
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as z:
            return all(i.header_offset + i.compress_size <= size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def _all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a barrier that also carries one flag)."""
    if not _dist():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item()) == 0.0


def _last_line(error: BaseException) -> str:
    """The gist of an error whose text may hold tracebacks (DCP's CheckpointException)."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is the disk running full: ENOSPC / EDQUOT, or torch's
    archive writer finding fewer bytes written than it wrote ("unexpected pos")."""
    e: BaseException | None = error
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _warn_if_schedule_changed(name: str, obj: Any, step: int) -> None:
    """A LambdaLR schedule (``warmup_cosine``) is rebuilt from the config on resume, its position
    restored: if the config's horizon changed (a larger ``total_steps``), the lr jumps. Say so."""
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(obj, LambdaLR):
        return
    saved = obj.get_last_lr()
    now = [base * fn(obj.last_epoch) for fn, base in zip(obj.lr_lambdas, obj.base_lrs)]
    if any(abs(a - b) > 1e-9 * max(abs(a), abs(b)) for a, b in zip(saved, now)):
        log.warning(
            "resumed at step %d: the %s of this config gives lr %.3g where the checkpoint's run "
            "had %.3g (lr_scheduler changed, e.g. a larger total_steps: the schedule follows the "
            "new horizon from here); to keep the old schedule set lr_scheduler.total_steps to the "
            "old value",
            step,
            name,
            now[0],
            saved[0],
        )


def _model_state(models: dict) -> dict[str, Any]:
    """The DCP state of ``{name: (model, optimizer or None)}``: ``name`` and ``name_optim`` keys."""
    state: dict[str, Any] = {}
    for name, (model, optim) in models.items():
        if optim is None:
            state[name] = get_state_dict(model, [])[0]
        else:
            state[name], state[name + "_optim"] = get_state_dict(model, optim)
    return state
