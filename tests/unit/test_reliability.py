"""The library parts behind clear failures: a full disk during a checkpoint save, a partial metrics
line, a schedule that changed on resume, the config schema, one-line reports, the signal handling
at step boundaries and processes that die with their parent."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from minippo.config import ConfigError, load_config
from minippo.config.schema import Bool, Component, Float, Int, Section, Str, check_schema
from minippo.training import checkpoint as ckpt_mod
from minippo.training.checkpoint import Checkpointer
from minippo.training.interrupt import Interrupted, StopOnSignal
from minippo.training.metrics import JsonlLogger, read_jsonl


def _model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # what torch's archive writer raises when the disk fills up mid-file
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    ],
)
def test_full_disk_during_a_save_is_named_and_the_partial_checkpoint_removed(
    tmp_path, monkeypatch, error
):
    model, optim = _model()
    ckpt = Checkpointer(tmp_path)
    first = ckpt.save(1, models={"actor": (model, optim)}, states={})

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    with pytest.raises(OSError) as e:
        ckpt.save(2, models={"actor": (model, optim)}, states={})
    msg = str(e.value)
    assert "checkpoint step_000002 could not be written to" in msg
    assert "no space left on device" in msg and "MiB free" in msg
    assert f"the previous checkpoint {first} is intact" in msg
    assert "set checkpoint.dir to another disk" in msg
    assert not (tmp_path / "step_000002.tmp").exists()  # the partial checkpoint is gone
    assert ckpt.resolve("latest") == first


def test_a_changed_lr_schedule_on_resume_is_reported(tmp_path, caplog):
    from minippo.training.schedules import warmup_cosine

    model, optim = _model()
    sched = warmup_cosine(optim, total_steps=4, min_lr_ratio=0.1)
    for _ in range(4):
        optim.step()
        sched.step()
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(4, models={"actor": (model, optim)}, states={"scheduler": sched})

    def resume(total_steps):
        m, o = _model()
        s = warmup_cosine(o, total_steps=total_steps, min_lr_ratio=0.1)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            ckpt.load(path, models={"actor": (m, o)}, states={"scheduler": s})
        return caplog.text

    assert "lr_scheduler" not in resume(4)  # the same horizon: nothing to say
    text = resume(8)  # a larger total_steps: the lr jumps up from 0.01 to the new curve
    assert "resumed at step 4: the scheduler of this config gives lr 0.055" in text
    assert "the checkpoint's run had 0.01" in text and "lr_scheduler.total_steps" in text


def test_metrics_file_with_a_partial_last_line_resumes(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "train/loss": 0.5}) for s in range(3)]
    path.write_text("\n".join(rows) + '\n{"step": 3, "train/lo')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    assert "partial last line" in caplog.text
    logger = JsonlLogger(path)
    logger.log({"train/loss": 0.25}, step=2)  # a run resumed at step 2
    logger.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    path.write_text(rows[0] + "\nnot json\n" + rows[1] + "\n")  # damage inside the file
    with pytest.raises(ValueError, match="line 2 is not a metrics row"):
        read_jsonl(path)


def test_schema_reports_every_problem_with_close_matches():
    schema = {
        "steps": Int(min=1),
        "lr": Float(gt=0),
        "name": Str(("a", "b"), null=True),
        "flag": Bool(optional=True),
        "opt": Component({"lr": Float(gt=0)}),
        "sec": Section({"max_staleness": Int(min=0), "top_p": Float(gt=0, max=1)}),
    }
    cfg = OmegaConf.create(
        {
            "steps": "abc",
            "lr": float("nan"),
            "name": None,
            "opt": {"_component_": "torch.optim.SGD", "lr": -1, "momentum": 0.9},
            "sec": {"max_stalenes": 1, "top_p": 0},
            "stepz": 1,
        }
    )
    assert check_schema(cfg, schema) == [
        "steps must be an integer >= 1, got 'abc'",
        "lr must be a number > 0, got nan",
        "opt.lr must be a number > 0, got -1",
        "unknown config key 'sec.max_stalenes' (the recipe does not read it); did you mean "
        "sec.max_staleness?",
        "sec.top_p must be a number in (0, 1], got 0",
        "unknown config key 'stepz' (the recipe does not read it); did you mean steps?",
    ]
    cfg = OmegaConf.create({"steps": True, "lr": 1, "name": "c", "opt": {}, "sec": None})
    assert check_schema(cfg, schema) == [
        "steps must be an integer >= 1, got True",
        "name must be one of ['a', 'b'] or null, got 'c'",
        "opt has no _component_ key: it must name what to build, e.g. "
        "opt._component_=<module.Class>",
        "sec must be a mapping, got null",
    ]


def test_report_is_one_line_and_names_the_cause(capsys, monkeypatch):
    from minippo.config import report_error

    monkeypatch.delenv("MINIPPO_LOG_LEVEL", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        try:
            raise ValueError("reward r returned nan for prompt 3")
        except ValueError as inner:
            raise RuntimeError("the rollout producer thread failed") from inner
    except RuntimeError as e:
        assert report_error(e) == 1
    assert capsys.readouterr().err == (
        "minippo: error: the rollout producer thread failed: reward r returned nan for prompt 3\n"
    )
    assert report_error(ConfigError("two", ["a must be x", "b must be y"])) == 2
    assert capsys.readouterr().err == "minippo: error: a must be x\nminippo: error: b must be y\n"
    assert report_error(KeyError("k")) == 1  # a bug: its type is named, the traceback offered
    assert capsys.readouterr().err == (
        "minippo: error: KeyError: 'k' (MINIPPO_LOG_LEVEL=DEBUG prints the traceback)\n"
    )
    assert report_error(Interrupted(7, signal.SIGTERM)) == 143
    assert capsys.readouterr().err == "interrupted at step 7; resume with resume_from=latest\n"


def test_config_file_that_is_a_folder_and_home_paths(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="is a folder; give a YAML file"):
        load_config(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("tiny_cpu", ["output_dir=~/runs/a"])
    assert cfg.checkpoint.dir == str(tmp_path / "runs" / "a" / "checkpoints")


def test_a_signal_stops_at_the_step_end_after_saving():
    stop = StopOnSignal(grace_s=60).install()
    saved = []
    try:
        stop.at_step_end(1, save=saved.append)  # no signal: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread
        with pytest.raises(Interrupted) as e:
            stop.at_step_end(2, save=saved.append)
    finally:
        stop.uninstall()
    assert saved == [2] and e.value.step == 2 and e.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_step_that_does_not_end_in_time_exits_without_saving():
    code = textwrap.dedent(
        """
        import os, signal, time
        from minippo.training.interrupt import StopOnSignal
        stop = StopOnSignal(grace_s=1).install()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)  # a step far longer than the grace period
        """
    )
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and time.time() - t0 < 30
    assert "did not end within 1 s; the last complete checkpoint is kept" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("prctl", [True, False])
def test_a_process_dies_with_its_parent(tmp_path, prctl):
    """A parent starts a child that calls die_with_parent, then is SIGKILLed: the child follows
    (through the kernel's parent-death signal, or through the watchdog thread alone)."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import time; from minippo.parallel.distributed import die_with_parent; "
        f"die_with_parent(prctl={prctl}); open({str(pid_file)!r}, 'w').write(str(__import__('os')"
        ".getpid())); time.sleep(120)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.time() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    child_pid = int(pid_file.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the child outlived its parent by 5 s")
