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
checkpoint folder rank 0 creates).
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
        self._lock_fd: int | None = None

    @classmethod
    def of_run(cls, cfg: Any) -> OutputDir:
        """The output folder of a recipe config: ``output_dir``, whose outputs are the checkpoint
        folder, the metrics file and ``hf_export``; ``resume_from`` and ``overwrite_output_dir``."""
        root = Path(cfg.output_dir).expanduser().resolve()
        outputs = [cfg.checkpoint.dir, root / "hf_export"]
        if cfg.get("metric_logger") and cfg.metric_logger.get("path"):
            outputs.append(cfg.metric_logger.path)
        return cls(
            root,
            outputs,
            resume=cfg.get("resume_from") not in (None, "", "null"),
            overwrite=bool(cfg.get("overwrite_output_dir", False)),
        )

    @property
    def export_dir(self) -> Path:
        """Where the run writes its HF export."""
        return self.path / "hf_export"

    def claim(self) -> None:
        """Check the folder, take the lock, and (with ``overwrite``) delete the old outputs."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(
                f"output_dir={self.path} is a file, not a folder; choose another output_dir"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        found = [p for p in self.outputs if p.exists() and _nonempty(p)]
        if found and not self.resume and not self.overwrite:
            self.release()
            names = ", ".join(str(p) for p in found)
            raise ConfigError(
                f"output_dir={self.path} holds another run's outputs ({names}); resume that run "
                "with resume_from=latest, choose another output_dir, or set "
                "overwrite_output_dir=true to delete them and start anew"
            )
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
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"output_dir={self.path} is in use by another run ({holder}); wait for it to "
                "finish or stop it, or choose another output_dir"
            ) from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        if previous:  # the lock was free, so its last holder is gone (or ended without release)
            log.warning("output_dir=%s: taking over from an ended run (%s)", self.path, previous)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        info = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%F %T')}"
        os.write(fd, info.encode())
        os.fsync(fd)
        self._lock_fd = fd

    def release(self) -> None:
        """Give the folder up (idempotent); the lock file stays, empty, for the next run."""
        if self._lock_fd is None:
            return
        os.ftruncate(self._lock_fd, 0)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None


def _nonempty(path: Path) -> bool:
    return path.is_file() or any(path.iterdir())
