"""Kill a process at every write point of the end of a training step, then resume.

Run as ``python -m tests.crash_points OUT_DIR [--quick]``; prints one ``RESULT=<json>`` line that
tests/unit/test_checkpoint_crash_points.py checks.

What a run writes after a training step, in the recipe's order: the step's metrics line
(``JsonlLogger``), the checkpoint (``Checkpointer.save``: each DCP file and the DCP metadata, the
per-rank extra state, ``meta.json``, the rename of ``step_N.tmp``, the ``latest`` pointer, the
pruning of old checkpoints) and, at the end of the run, the HF export (``parallel.export_hf``).
Every one of those operations on a path under ``OUT_DIR`` is an event: a file opened for writing,
a rename or replace, a deletion, a safetensors file, a metrics line.

1. The parent builds the tiny model, logs step 0, saves checkpoint 1 (the baseline), trains a step.
2. A forked child runs the writes of step 2 once, recording the events in order (the dry run).
3. For every event and mode, a fresh copy of the baseline folder and a forked child that runs the
   same writes and SIGKILLs itself *before* the event, *after* it (a file created but empty), or,
   for the metrics line, *torn* (half a line written). Fork keeps this fast: no interpreter start
   per case.
4. The parent then resumes as ``resume_from=latest`` does: ``resolve("latest")`` must name a
   complete checkpoint, the step the kill left behind (2 once the ``latest`` pointer was replaced,
   else 1); loading it must give that step's weights, optimizer and states bit for bit; the
   resumed logger keeps the rows before that step; a new save and a new HF export over whatever
   the kill left succeed and load.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import torch

from minippo.models import Transformer, from_pretrained, init_weights, qwen3_tiny, token_logprobs
from minippo.parallel import export_hf
from minippo.training.checkpoint import Checkpointer, RNGState
from minippo.training.metrics import JsonlLogger, read_jsonl

MODES = ("before", "after")


class Box:
    """A Stateful holding one value (stands for the queue, correction, schedulers...)."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class Writes:
    """Intercepts the write operations on paths under ``root``: each is an event, numbered in
    order; ``kill_at`` (index, mode) SIGKILLs the process there."""

    def __init__(self, root: Path, kill_at: tuple[int, str] | None = None):
        self.root = str(root.resolve())
        self.kill_at = kill_at
        self.events: list[str] = []

    def _rel(self, path) -> str | None:
        p = os.path.abspath(os.fspath(path))
        return os.path.relpath(p, self.root) if p.startswith(self.root + os.sep) else None

    def event(self, label: str, action, torn=None):
        i = len(self.events)
        self.events.append(label)
        mode = self.kill_at[1] if self.kill_at and self.kill_at[0] == i else None
        if mode == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "torn":
            torn()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            return action()
        finally:  # an action that raises (a missing file's unlink) is done too
            if mode == "after":
                os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        real_open, real_rename, real_replace = builtins.open, os.rename, os.replace
        real_unlink, real_rmtree = os.unlink, shutil.rmtree
        import safetensors.torch as st

        real_save_file = st.save_file
        real_log = JsonlLogger.log
        real_torch_save = torch.save

        def opener(file, mode="r", *args, **kwargs):
            rel = self._rel(file) if isinstance(file, (str, os.PathLike)) else None
            if rel is None or not any(c in mode for c in "wax+"):
                return real_open(file, mode, *args, **kwargs)
            return self.event(f"open {rel}", lambda: real_open(file, mode, *args, **kwargs))

        def mover(real, name):
            def move(src, dst, *args, **kwargs):
                rel = self._rel(dst)
                if rel is None or args or kwargs:
                    return real(src, dst, *args, **kwargs)
                return self.event(f"{name} {self._rel(src)} -> {rel}", lambda: real(src, dst))

            return move

        def unlink(path, *args, **kwargs):
            rel = self._rel(path) if not args and not kwargs else None  # dir_fd: inside rmtree
            if rel is None:
                return real_unlink(path, *args, **kwargs)
            return self.event(f"unlink {rel}", lambda: real_unlink(path))

        def rmtree(path, *args, **kwargs):
            rel = self._rel(path)
            if rel is None:
                return real_rmtree(path, *args, **kwargs)
            return self.event(f"rmtree {rel}", lambda: real_rmtree(path, *args, **kwargs))

        def save_file(tensors, filename, *args, **kwargs):
            call = lambda: real_save_file(tensors, filename, *args, **kwargs)  # noqa: E731
            return self.event(f"safetensors {self._rel(filename)}", call)

        def torch_save(obj, f, *args, **kwargs):  # its C++ writer opens the file itself
            rel = self._rel(f) if isinstance(f, (str, os.PathLike)) else None
            call = lambda: real_torch_save(obj, f, *args, **kwargs)  # noqa: E731
            return call() if rel is None else self.event(f"torch.save {rel}", call)

        def log(logger, metrics, step):
            def torn():  # half a line, as a write cut short leaves it
                with real_open(logger.path, "a", encoding="utf-8") as f:
                    f.write(f'{{"step": {step}, "train/lo')

            call = lambda: real_log(logger, metrics, step)  # noqa: E731
            return self.event(f"metrics line step {step}", call, torn=torn)

        builtins.open = io.open = opener
        os.rename, os.replace = mover(real_rename, "rename"), mover(real_replace, "replace")
        os.unlink, shutil.rmtree = unlink, rmtree
        st.save_file = save_file
        torch.save = torch_save
        JsonlLogger.log = log


def build(seed: int = 0):
    model = init_weights(Transformer(qwen3_tiny()), seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model, optim, seed: int) -> None:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    (-token_logprobs(model, tokens, start=4).sum()).backward()
    optim.step()
    optim.zero_grad()


def end_of_step(out: Path, model, optim, step: int, value: int, export: bool) -> None:
    """The recipe's writes after training step ``step - 1``: its metrics line, checkpoint
    ``step`` and (at the end of the run) the HF export."""
    logger = JsonlLogger(out / "metrics.jsonl")
    logger.log({"train/loss": float(step - 1)}, step=step - 2)  # the line already written
    writes = Writes(out, KILL_AT)
    writes.install()
    logger.log({"train/loss": float(step)}, step=step - 1)
    ckpt = Checkpointer(out / "checkpoints", keep_last=1)
    ckpt.save(step, models={"actor": (model, optim)}, states={"box": Box(value), "rng": RNGState()})
    if export:
        export_hf(model, out / "hf_export")
    if KILL_AT is None:
        (out / "events.json").write_text(json.dumps(writes.events))


KILL_AT: tuple[int, str] | None = None


def run_child(fn) -> int:
    """``fn()`` in a forked child; returns its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def snapshot(model, optim, value: int) -> tuple[dict, dict, int]:
    """Copies of (weights, optimizer state, the Box value) saved with a checkpoint."""
    state = optim.state_dict()["state"]
    moments = {i: {k: t.clone() for k, t in s.items()} for i, s in state.items()}
    return {k: t.clone() for k, t in model.state_dict().items()}, moments, value


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_resume(case: Path, expected: int, saved: dict) -> None:
    """What ``resume_from=latest`` does after the kill, step by step."""
    ckpt = Checkpointer(case / "checkpoints", keep_last=1)
    path = ckpt.resolve("latest")
    model, optim = build(seed=9)
    box, rng = Box(), RNGState()
    meta = ckpt.load(path, models={"actor": (model, optim)}, states={"box": box, "rng": rng})
    assert meta["step"] == expected, f"latest names step {meta['step']}, expected {expected}"
    weights, optim_state, value = saved[expected]
    assert same(model.state_dict(), weights), "weights differ from the saved step"
    assert box.value == value
    st = optim.state_dict()["state"]
    assert all(torch.equal(st[i]["exp_avg"], optim_state[i]["exp_avg"]) for i in optim_state)
    # the resumed run logs from step `expected` on: earlier rows kept, later ones (and a torn
    # line) dropped
    logger = JsonlLogger(case / "metrics.jsonl")
    logger.log({"train/loss": -1.0}, step=expected)
    logger.close()
    rows = read_jsonl(case / "metrics.jsonl")
    assert [r["step"] for r in rows] == [*range(expected), expected], rows
    # its next checkpoint and export go through whatever the kill left behind
    train_step(model, optim, seed=expected + 10)
    ckpt.save(expected + 1, models={"actor": (model, optim)}, states={"box": box, "rng": rng})
    assert ckpt.resolve("latest").name == f"step_{expected + 1:06d}"
    assert not list((case / "checkpoints").glob("*.tmp"))
    export_hf(model, case / "hf_export")
    reloaded = from_pretrained(case / "hf_export")
    tokens = torch.arange(8)[None]
    with torch.no_grad():
        assert torch.equal(reloaded(tokens), model(tokens))


def main(out: Path, quick: bool) -> list[dict]:
    global KILL_AT
    torch.set_num_threads(1)
    base = out / "baseline"
    model, optim = build()
    # step 0's metrics line and checkpoint 1 (the baseline every case starts from)
    logger = JsonlLogger(base / "metrics.jsonl")
    logger.log({"train/loss": 0.0}, step=0)
    logger.close()
    train_step(model, optim, seed=1)
    Checkpointer(base / "checkpoints", keep_last=1).save(
        1, models={"actor": (model, optim)}, states={"box": Box(1), "rng": RNGState()}
    )
    saved = {1: snapshot(model, optim, 1)}
    train_step(model, optim, seed=2)
    saved[2] = snapshot(model, optim, 2)

    dry = out / "dry"
    shutil.copytree(base, dry)
    status = run_child(lambda: end_of_step(dry, model, optim, 2, 2, export=True))
    assert status == 0, f"the dry run failed (status {status})"
    events = json.loads((dry / "events.json").read_text())
    latest = events.index("replace checkpoints/latest.tmp -> checkpoints/latest")

    results = []
    for i, label in enumerate(events):
        modes = ("before", "after", "torn") if label.startswith("metrics line") else MODES
        if quick and label.startswith("open checkpoints/step_000002.tmp/__"):
            modes = ("after",)
        for mode in modes:
            case = out / f"case_{i:02d}_{mode}"
            shutil.copytree(base, case)
            KILL_AT = (i, mode)
            status = run_child(lambda c=case: end_of_step(c, model, optim, 2, 2, export=True))
            KILL_AT = None
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            expected = 2 if (i > latest or (i == latest and mode == "after")) else 1
            error = None if killed else f"the child was not killed (status {status})"
            if error is None:
                try:
                    check_resume(case, expected, saved)
                except Exception as e:  # reported per case
                    error = f"{type(e).__name__}: {e}"
            results.append(dict(event=label, mode=mode, expected_step=expected, error=error))
            shutil.rmtree(case, ignore_errors=True)
    return results


if __name__ == "__main__":
    results = main(Path(sys.argv[1]), quick="--quick" in sys.argv)
    print("RESULT=" + json.dumps(results))
