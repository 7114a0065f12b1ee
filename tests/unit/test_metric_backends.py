"""The TensorBoard and W&B loggers, built from a config node as the recipe builds them, against
recording stand-ins of ``torch.utils.tensorboard.SummaryWriter`` and ``wandb`` (neither package
is a dependency): every metric reaches the backend as a float at its step, the config once, and
close flushes the backend."""

import json
import sys
import types
from typing import ClassVar

import torch
from omegaconf import OmegaConf

from minippo.config import instantiate


class FakeSummaryWriter:
    instances: ClassVar[list["FakeSummaryWriter"]] = []

    def __init__(self, log_dir=None):
        self.log_dir = log_dir
        self.calls: list[tuple] = []
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag, value, global_step=None):
        self.calls.append(("scalar", tag, value, global_step))

    def add_text(self, tag, text):
        self.calls.append(("text", tag, text))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def test_tensorboard_logger_writes_scalars_config_and_closes(monkeypatch, tmp_path):
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    FakeSummaryWriter.instances.clear()
    cfg = OmegaConf.create(
        {"_component_": "minippo.training.metrics.TensorBoardLogger", "log_dir": str(tmp_path)}
    )
    lg = instantiate(cfg)
    lg.log_config({"seed": 3, "optimizer": {"lr": 0.1}})
    lg.log({"train/loss": torch.tensor(0.25), "rollout/n": 2}, step=7)
    lg.close()
    (w,) = FakeSummaryWriter.instances
    assert w.log_dir == str(tmp_path)
    text = w.calls[0]
    assert text[:2] == ("text", "config") and json.loads(text[2].strip("`\n"))["seed"] == 3
    scalars = [c for c in w.calls if c[0] == "scalar"]
    assert scalars == [("scalar", "train/loss", 0.25, 7), ("scalar", "rollout/n", 2.0, 7)]
    assert all(type(c[2]) is float for c in scalars)
    assert w.calls[-2:] == [("flush",), ("close",)]  # flushed after the step, closed at the end


def test_wandb_logger_inits_logs_at_the_step_updates_config_and_finishes(monkeypatch, tmp_path):
    calls: list[tuple] = []

    class Config:
        def update(self, d, allow_val_change=False):
            calls.append(("config", d, allow_val_change))

    class Run:
        config = Config()

        def log(self, d, step=None):
            calls.append(("log", d, step))

        def finish(self):
            calls.append(("finish",))

    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = OmegaConf.create(
        {
            "_component_": "minippo.training.metrics.WandBLogger",
            "project": "p",
            "name": "run1",
            "log_dir": str(tmp_path),
            "mode": "offline",
        }
    )
    lg = instantiate(cfg)
    lg.log_config({"seed": 3})
    lg.log({"train/loss": torch.tensor(0.5)}, step=4)
    lg.close()
    assert calls == [
        ("init", {"project": "p", "name": "run1", "dir": str(tmp_path), "mode": "offline"}),
        ("config", {"seed": 3}, True),
        ("log", {"train/loss": 0.5}, 4),
        ("finish",),
    ]
    assert type(calls[2][1]["train/loss"]) is float
