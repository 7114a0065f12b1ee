"""minippo/training/placement.py: the run's decisions outside the planner, shared by the recipe
and ``minippo plan``; an alternate-mode queue state saved under the earlier module name loads."""

import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import minippo.plan
from minippo.config import ConfigError
from minippo.engine.protocol import Completion
from minippo.training import placement
from minippo.training.checkpoint import load_extra_state
from minippo.training.rollout_queue import _Group, _Sample

ROOT = Path(__file__).resolve().parents[2]


def test_the_recipe_and_the_plan_call_the_same_functions():
    recipe = (ROOT / "recipes" / "async_ppo.py").read_text()
    assert "minippo.plan" not in recipe and "isinstance(self.engine" not in recipe
    for name in ("rollout_mode", "sglang_on_gpu", "cap_trainer_memory"):
        assert getattr(minippo.plan, name) is getattr(placement, name)


def test_rollout_mode_and_sglang_on_gpu():
    cfg = OmegaConf.create
    assert placement.rollout_mode(cfg({})) == "overlap"  # the recipe's default
    assert placement.rollout_mode(cfg({"rollout": {"mode": "alternate"}})) == "alternate"
    with pytest.raises(
        ConfigError, match=r"rollout\.mode='both' must be one of alternate, overlap"
    ):
        placement.rollout_mode(cfg({"rollout": {"mode": "both"}}))
    sglang = "minippo.engine.sglang_engine.SGLangEngine"
    assert placement.sglang_on_gpu(cfg({"engine": {"_component_": sglang}}))
    assert not placement.sglang_on_gpu(cfg({"engine": {"_component_": sglang, "device": "cpu"}}))
    torch_engine = "minippo.engine.torch_engine.TorchEngine"
    assert not placement.sglang_on_gpu(cfg({"engine": {"_component_": torch_engine}}))


def test_cap_trainer_memory_does_nothing_off_a_shared_gpu():
    cfg = OmegaConf.create({"engine": {"_component_": "x.SGLangEngine"}})
    placement.cap_trainer_memory(cfg, "cpu")  # no GPU: nothing to cap, the planner is not read


def test_carried_groups_saved_by_the_earlier_alternating_queue_load(tmp_path, monkeypatch):
    """A checkpoint of an alternate-mode run written before the queues merged names its carried
    groups ``minippo.training.alternating_queue._Group`` / ``_Sample``: they still load."""
    old = types.ModuleType("minippo.training.alternating_queue")
    old._Group, old._Sample = _Group, _Sample
    monkeypatch.setitem(sys.modules, old.__name__, old)
    for cls in (_Group, _Sample):
        monkeypatch.setattr(cls, "__module__", old.__name__)
    done = Completion("g0-n0-a0-s0", [1, 2], [5], [-0.5], [0], "abort")
    path = tmp_path / "extra_rank0.pt"
    torch.save({"queue": {"carried": [_Group(0, [1, 2], [1, 2], [_Sample(7, done)])]}}, path)
    assert b"alternating_queue" in path.read_bytes()
    monkeypatch.undo()
    (group,) = load_extra_state(path)["queue"]["carried"]
    assert isinstance(group, _Group) and group.samples[0].done.token_ids == [5]
