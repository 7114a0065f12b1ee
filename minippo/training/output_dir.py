"""One run per output folder.

A run writes metrics, checkpoints and an HF export under ``output_dir``. Two rules keep what is
already there safe:

* **A folder with another run's outputs is refused** unless the run resumes them
  (``resume_from=latest`` or a path) or the user asks to replace them (``overwrite_output_dir=true``,
  which deletes exactly those outputs first). Otherwise a fresh run would truncate the old metrics,
  replace its export and mix its checkpoints with the old ones.
* **One live run per folder**: the run holds an exclusive ``flock`` on ``output_dir/.minippo.lock``
  (which also records its PID) until it ends. A second run is refused with the first one's PID.
  The operating system releases the lock when its holder dies (kill -9 included), so a lock left
  behind by a dead run never blocks: the next run reports that it takes it over.

Only global rank 0 claims the folder (the other ranks write nothing but checkpoint shards, into the
checkpoint folder rank 0 creates). :meth:`OutputDir.problems` makes the same checks without
writing anything (``minippo validate``, and every run before it builds anything).

**A new folder per launch**: the built-in configs name ``output_dir`` with the launch time
(``/tmp/minippo/tiny_cpu/${now:%Y%m%d-%H%M%S}``), so running one twice keeps both runs. After a
run of such a folder ends well, ``minippo run`` points ``latest`` beside it at it
(:func:`link_latest`: ``/tmp/minippo/tiny_cpu/latest``), which ``tiny_eval_cpu`` reads.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from minippo.config import ConfigError
from minippo.config._parse import PER_LAUNCH

log = logging.getLogger(__name__)
LOCK_NAME = ".minippo.lock"


class OutputDir:
    """Claim ``path`` for this run; see the module docstring.

    Args:
        path: the run's ``output_dir``.
        outputs: the files and folders this run writes (metrics file, checkpoint folder, export).
        resume: this run continues the outputs found there (``resume_from`` is set).
        overwrite: delete the ``outputs`` found there before starting (``overwrite_output_dir``).
    """

    def __init__(
        self, path: str | os.PathLike, outputs: Iterable[str | os.PathLike], *, resume: bool,
        overwrite: bool,
    ) -> None:  # fmt: skip
        self.path = Path(path).expanduser().resolve()
        self.outputs = [Path(p).expanduser().resolve() for p in outputs]
        self.resume = resume
        self.overwrite = overwrite
        self.per_launch = False  # output_dir names the launch time (${now:...}): see link_latest
        self._lock_fd: int | None = None

    @classmethod
    def of_run(cls, cfg: Any) -> OutputDir:
        """The output folder of a recipe config: ``output_dir``, whose outputs are the checkpoint
        folder and ``hf_export`` (a config with a ``checkpoint`` section: training), the metrics
        file and ``samples_path`` (evaluation); ``resume_from`` and ``overwrite_output_dir``."""
        root = Path(cfg.output_dir).expanduser().resolve()
        outputs: list[Any] = []
        if cfg.get("checkpoint") and cfg.checkpoint.get("dir"):
            outputs += [cfg.checkpoint.dir, root / "hf_export"]
        if cfg.get("metric_logger") and cfg.metric_logger.get("path"):
            outputs.append(cfg.metric_logger.path)
        if isinstance(cfg.get("samples_path"), str):
            outputs.append(cfg.samples_path)
        from minippo.training.preflight import setting

        out = cls(
            root,
            outputs,
            resume=cfg.get("resume_from") not in (None, "", "null"),
            overwrite=bool(setting(cfg, "overwrite_output_dir")),  # the schema's default
        )
        out.per_launch = "output_dir" in getattr(cfg, PER_LAUNCH, ())
        return out

    @property
    def export_dir(self) -> Path:
        """Where the run writes its HF export."""
        return self.path / "hf_export"

    def problems(self) -> list[str]:
        """What :meth:`claim` would refuse the folder for, found without writing anything: a
        file, a folder that cannot be written, a live run's lock, another run's outputs."""
        if self.path.exists() and not self.path.is_dir():
            return [self._is_a_file()]
        base = _first_existing(self.path)
        if not base.is_dir():
            return [f"output_dir={self.path} lies under the file {base}; choose another output_dir"]
        if not os.access(base, os.W_OK | os.X_OK):
            return [self._not_writable(base, "permission denied")]
        lock = self.path / LOCK_NAME
        if lock.is_file():
            try:
                fd = os.open(lock, os.O_RDONLY)
            except OSError as e:
                return [self._not_writable(lock, e.strerror or str(e))]
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once, by close
            except BlockingIOError:
                return [self._in_use(os.read(fd, 4096))]
            finally:
                os.close(fd)
        found = self._found()
        if found and not self.resume and not self.overwrite:
            return [self._holds_outputs(found)]
        return []

    def claim(self) -> None:
        """Check the folder, take the lock, and (with ``overwrite``) delete the old outputs."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(self._is_a_file())
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
        except OSError as e:
            raise ConfigError(self._not_writable(self.path, e.strerror or str(e))) from e
        found = self._found()
        if found and not self.resume and not self.overwrite:
            self.release()
            raise ConfigError(self._holds_outputs(found))
        if found and self.overwrite and not self.resume:
            for p in found:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            log.warning("overwrite_output_dir=true: deleted %s", ", ".join(map(str, found)))

    def _lock(self) -> None:
        lock = self.path / LOCK_NAME
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096)
            os.close(fd)
            raise ConfigError(self._in_use(holder)) from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        if previous:  # the lock was free, so its last holder is gone (or ended without release)
            log.warning("output_dir=%s: taking over from an ended run (%s)", self.path, previous)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        info = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%F %T')}"
        os.write(fd, info.encode())
        os.fsync(fd)
        self._lock_fd = fd
        if self.per_launch:
            global claimed_per_launch
            claimed_per_launch = self.path

    def release(self) -> None:
        """Give the folder up (idempotent); the lock file stays, empty, for the next run."""
        global claimed_per_launch
        if self._lock_fd is None:
            return
        if claimed_per_launch == self.path:
            claimed_per_launch = None
        os.ftruncate(self._lock_fd, 0)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None

    # ---- the messages of problems() and claim(), the same words from both
    def _found(self) -> list[Path]:
        return [p for p in self.outputs if p.exists() and _nonempty(p)]

    def _is_a_file(self) -> str:
        return f"output_dir={self.path} is a file, not a folder; choose another output_dir"

    def _not_writable(self, where: Path, why: str) -> str:
        return (
            f"output_dir={self.path}: cannot write in {where} ({why}); choose an output_dir you "
            "can write to (e.g. output_dir=~/minippo_runs/run1)"
        )

    def _in_use(self, holder: bytes) -> str:
        who = holder.decode(errors="replace").strip() or "unknown"
        return (
            f"output_dir={self.path} is in use by another run ({who}); wait for it to finish or "
            "stop it, or choose another output_dir"
        )

    def _holds_outputs(self, found: list[Path]) -> str:
        names = ", ".join(str(p) for p in found)
        return (
            f"output_dir={self.path} holds another run's outputs ({names}); resume that run "
            "with resume_from=latest, choose another output_dir, or set "
            "overwrite_output_dir=true to delete them and start anew"
        )


LATEST = "latest"
# the per-launch folder this process claimed (None: none): an interrupted run's resume hint names it
claimed_per_launch: Path | None = None


def link_latest(run_dir: str | os.PathLike) -> Path:
    """Point ``<parent of run_dir>/latest`` at ``run_dir`` (a relative symlink, replaced
    atomically); returns the link. ``minippo run`` calls it after a run of a per-launch folder
    ends well, so ``.../latest/hf_export`` is the newest finished run's export."""
    run_dir = Path(run_dir).expanduser().resolve()
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(run_dir.name, tmp)
    os.replace(tmp, link)
    return link


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _nonempty(path: Path) -> bool:
    return path.is_file() or any(path.iterdir())
