"""One run per output folder: used folders are refused, live runs lock theirs (minippo.training.output_dir)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from omegaconf import OmegaConf

from minippo.config import ConfigError
from minippo.training.output_dir import LOCK_NAME, OutputDir


def _cfg(out, **extra):
    return OmegaConf.create(
        {
            "output_dir": str(out),
            "checkpoint": {"dir": f"{out}/checkpoints"},
            "metric_logger": {"path": f"{out}/metrics.jsonl"},
            "resume_from": None,
            **extra,
        }
    )


def _used(out):
    (out / "checkpoints" / "step_000030").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "hf_export").mkdir()
    (out / "hf_export" / "config.json").write_text("{}")


def test_fresh_folder_is_claimed_and_released(tmp_path):
    out = tmp_path / "run"
    d = OutputDir.of_run(_cfg(out))
    d.claim()
    assert (out / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")
    d.release()
    assert (out / LOCK_NAME).read_text() == ""  # released cleanly: nothing to take over
    d.release()  # idempotent


def test_a_fresh_run_into_a_used_folder_is_refused_and_nothing_is_touched(tmp_path):
    out = tmp_path / "run"
    _used(out)
    with pytest.raises(ConfigError) as e:
        OutputDir.of_run(_cfg(out)).claim()
    msg = str(e.value)
    assert "holds another run's outputs" in msg and "resume_from=latest" in msg
    assert "overwrite_output_dir=true" in msg and "metrics.jsonl" in msg
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (out / "checkpoints" / "step_000030").is_dir() and (out / "hf_export").is_dir()
    # the refused run does not keep the folder locked
    OutputDir.of_run(_cfg(out, resume_from="latest")).claim()


def test_resume_keeps_and_overwrite_deletes_the_outputs(tmp_path):
    out = tmp_path / "run"
    _used(out)
    d = OutputDir.of_run(_cfg(out, resume_from="latest"))
    d.claim()
    assert (out / "checkpoints" / "step_000030").is_dir()
    d.release()
    (out / "notes.txt").write_text("mine")
    OutputDir.of_run(_cfg(out, overwrite_output_dir=True)).claim()
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert not (out / "hf_export").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own outputs go


def test_output_dir_that_is_a_file_and_home_expansion(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        OutputDir.of_run(_cfg(f)).claim()
    monkeypatch.setenv("HOME", str(tmp_path))
    d = OutputDir.of_run(_cfg("~/runs/a"))
    assert d.path == tmp_path / "runs" / "a"


HOLDER = textwrap.dedent(
    """
    import sys, time
    from omegaconf import OmegaConf
    from minippo.training.output_dir import OutputDir
    out = sys.argv[1]
    cfg = OmegaConf.create({"output_dir": out, "checkpoint": {"dir": out + "/checkpoints"},
                            "metric_logger": {"path": out + "/metrics.jsonl"}})
    OutputDir.of_run(cfg).claim()
    print("claimed", flush=True)
    time.sleep(60)
    """
)


def test_a_second_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ConfigError) as e:
            OutputDir.of_run(_cfg(out)).claim()
        assert f"in use by another run (pid {holder.pid} " in str(e.value)
        assert "choose another output_dir" in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    # killed without releasing: its PID is still in the file, but the lock died with it
    assert f"pid {holder.pid} " in (out / LOCK_NAME).read_text()
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        OutputDir.of_run(_cfg(out)).claim()
    assert time.perf_counter() - t0 < 5
    assert f"taking over from an ended run (pid {holder.pid} " in caplog.text
