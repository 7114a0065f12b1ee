"""Checkpointer: round trip, atomic saves, resume_from resolution."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from minippo.training.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpointer,
    RNGState,
    step_dir_name,
)


def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _train_one_step(model, optim, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


class _Box:
    """A Stateful holding one picklable value."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_restores_model_optimizer_extra_and_rng(tmp_path):
    model, optim = _model_and_optim(0)
    critic = nn.Linear(3, 1)
    _train_one_step(model, optim, 1)
    ckpt = Checkpointer(tmp_path / "ckpt")
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    path = ckpt.save(
        1,
        models={"actor": (model, optim), "frozen": (critic, None)},
        states={
            "rng": RNGState(),
            "queue": _Box({"epoch": 2, "offset": 7}),
            "blob": _Box(torch.arange(3)),
        },
        meta={"version": 1},
    )
    assert path.name == step_dir_name(1) == "step_000001"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000001"
    assert json.loads((path / "meta.json").read_text())["version"] == 1

    # a differently initialised model + fresh optimizer get exactly the saved state back
    model2, optim2 = _model_and_optim(99)
    critic2 = nn.Linear(3, 1)
    queue, blob = _Box(), _Box()
    torch.rand(5)  # move the RNG on: loading restores it
    meta = ckpt.load(
        ckpt.resolve("latest"),
        models={"actor": (model2, optim2), "frozen": (critic2, None)},
        states={"rng": RNGState(), "queue": queue, "blob": blob},
    )
    assert meta["format"] == CHECKPOINT_FORMAT
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
    assert meta["step"] == 1 and meta["world_size"] == 1
    for k, v in _params(model).items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(critic2.weight, critic.weight, rtol=0, atol=0)
    assert queue.value == {"epoch": 2, "offset": 7}
    assert torch.equal(blob.value, torch.arange(3))
    # optimizer moments restored: the next step is identical on both copies
    _train_one_step(model, optim, 2)
    _train_one_step(model2, optim2, 2)
    for k, v in _params(model).items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_failed_save_leaves_previous_checkpoint_usable(tmp_path):
    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, models={"actor": (model, optim)}, states={"n": _Box(1)})
    saved = _params(model)
    _train_one_step(model, optim, 3)
    # the model shards are written, then writing the extra state fails half-way: the partial
    # checkpoint is removed and the message says the previous one is intact
    with pytest.raises(OSError, match="disk full") as e:
        ckpt.save(2, models={"actor": (model, optim)}, states={"bad": _Box(_Unpicklable())})
    assert f"the previous checkpoint {tmp_path / 'step_000001'} is intact" in str(e.value)
    assert not (tmp_path / "step_000002.tmp").exists()
    assert not (tmp_path / "step_000002").exists()
    assert (tmp_path / "latest").read_text().strip() == "step_000001"

    model2, optim2 = _model_and_optim(5)
    n = _Box()
    meta = ckpt.load(ckpt.resolve("latest"), models={"actor": (model2, optim2)}, states={"n": n})
    assert meta["step"] == 1 and n.value == 1
    for k, v in saved.items():
        torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)
    # the next save of that step succeeds
    ckpt.save(2, models={"actor": (model, optim)}, states={"n": _Box(2)})
    assert not (tmp_path / "step_000002.tmp").exists()
    assert ckpt.resolve("latest").name == "step_000002"


def test_kill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    """A real SIGKILL right before the final rename: the old checkpoint still loads."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from torch import nn
        from minippo.training import checkpoint as C
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        ck = C.Checkpointer({str(tmp_path)!r})
        ck.save(1, models={{"actor": (m, o)}}, states={{}})
        torch.save(m.state_dict(), {str(tmp_path / "ref.pt")!r})
        with torch.no_grad():
            m.weight.add_(1.0)
        real_rename = os.rename
        def rename(src, dst):
            if str(src).endswith("step_000002.tmp"):  # the final rename of the save
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
        os.rename = rename
        ck.save(2, models={{"actor": (m, o)}}, states={{}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "step_000002.tmp" / "meta.json").exists()  # it died at the last moment
    ckpt = Checkpointer(tmp_path)
    path = ckpt.resolve("latest")
    assert path.name == "step_000001"
    m = nn.Linear(3, 2)
    ckpt.load(path, models={"actor": (m, torch.optim.SGD(m.parameters(), lr=0.1))}, states={})
    ref = torch.load(tmp_path / "ref.pt")
    torch.testing.assert_close(m.weight, ref["weight"], rtol=0, atol=0)


def test_resave_same_step_and_keep_last(tmp_path):
    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, models={"actor": (model, optim)}, states={"s": _Box(step)})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    ckpt.save(
        3, models={"actor": (model, optim)}, states={"s": _Box(33)}
    )  # a re-run over old output
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002", "step_000003"]
    box = _Box()
    ckpt.load(
        ckpt.resolve(tmp_path / "step_000003"), models={"actor": (model, optim)}, states={"s": box}
    )
    assert box.value == 33


def test_resolve_errors_and_fresh_run(tmp_path):
    ckpt = Checkpointer(tmp_path)
    assert ckpt.resolve(None) is None and ckpt.resolve("null") is None
    with pytest.raises(FileNotFoundError, match="resume_from=null"):
        ckpt.resolve("latest")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)


def test_world_size_mismatch_is_refused(tmp_path):
    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(1, models={"actor": (model, optim)}, states={})
    meta = json.loads((path / "meta.json").read_text())
    meta["world_size"] = meta["shard_ranks"] = 8  # as FSDP over 8 ranks writes it
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="--nproc-per-node 8"):
        ckpt.load(path, models={"actor": (model, optim)}, states={})


def test_checkpoint_of_another_format_or_without_a_state_is_refused(tmp_path):
    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(1, models={"actor": (model, optim)}, states={"n": _Box(1)})
    with pytest.raises(ValueError, match=r"no state for \['queue'\]"):
        ckpt.load(path, models={"actor": (model, optim)}, states={"n": _Box(), "queue": _Box()})
    meta = json.loads((path / "meta.json").read_text())
    del meta["format"]  # as written before Stateful checkpoints
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        ValueError, match="has checkpoint format 1, but this minippo reads format 2"
    ):
        ckpt.load(path, models={"actor": (model, optim)}, states={"n": _Box()})


def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path):
    # an older run left steps 30 and 60; a save of step 5 (overwrite_output_dir deletes such
    # leftovers, but the checkpointer must not rely on it) must not be pruned as "the oldest"
    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (30, 60, 5):
        ckpt.save(step, models={"actor": (model, optim)}, states={})
    assert ckpt.resolve("latest").name == "step_000005"
    assert (tmp_path / "step_000005" / "meta.json").is_file()


class _RunsCode:
    """What a hostile pickle carries: unpickling it calls a function (here: writes a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_resume_refuses_a_planted_pickle_that_would_run_code(tmp_path, capsys):
    """extra_rank0.pt replaced by a pickle whose loading calls os.mkdir: the load refuses it
    before it runs (no folder appears), in one line that names the file and the global; a
    checkpoint written by the Checkpointer (plain states, the queue's dataclasses) still loads."""
    from minippo.config._report import report_error

    model, optim = _model_and_optim(0)
    ckpt = Checkpointer(tmp_path / "ckpt")
    path = ckpt.save(1, models={"m": (model, optim)}, states={"box": _Box({"a": [1, 2.0]})})
    box = _Box()
    ckpt.load(path, models={"m": (model, optim)}, states={"box": box})
    assert box.value == {"a": [1, 2.0]}

    marker = tmp_path / "code_ran"
    torch.save({"box": {"value": _RunsCode(marker)}}, path / "extra_rank0.pt")
    with pytest.raises(ValueError) as err:
        ckpt.load(path, models={"m": (model, optim)}, states={"box": _Box()})
    assert not marker.exists(), "the pickle's code ran"
    assert err.type.__name__ == "UnsafeCheckpointError"
    assert "extra_rank0.pt holds the global posix.mkdir" in str(err.value)
    assert report_error(err.value) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0] and "posix.mkdir" in lines[0], lines
