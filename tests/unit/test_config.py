"""Config loading, overrides, interpolation, instantiate and validate."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from minippo.config import (
    ConfigError,
    apply_overrides,
    instantiate,
    load_config,
    parse_recipe_args,
    validate,
)


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            output_dir: /tmp/run
            seed: 3
            total_steps: 10
            optimizer:
              _component_: torch.optim.SGD
              lr: 0.5
            logger:
              _component_: builtins.dict
              log_dir: ${output_dir}/logs
            layers: [1, 2]
            """
        )
    )
    return path


def test_load_applies_overrides_and_interpolation(cfg_file):
    cfg = load_config(cfg_file, ["seed=7", "optimizer.lr=0.25", "output_dir=/x", "layers=[3,4,5]"])
    assert cfg.seed == 7
    assert cfg.optimizer.lr == 0.25
    assert cfg.logger.log_dir == "/x/logs"  # interpolation sees the override
    assert list(cfg.layers) == [3, 4, 5]


def test_override_values_are_typed(cfg_file):
    cfg = load_config(cfg_file, ["seed=true", "total_steps=null", "+extra.name=abc"])
    assert cfg.seed is True
    assert cfg.total_steps is None
    assert cfg.extra.name == "abc"


def test_delete_key(cfg_file):
    cfg = load_config(cfg_file, ["~logger"])
    assert "logger" not in cfg


def test_unknown_key_suggests_and_explains_plus(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file, ["optimizer.lrr=1"])
    msg = str(e.value)
    assert "optimizer.lrr" in msg and "optimizer.lr" in msg and "+optimizer.lrr=1" in msg


def test_bad_override_syntax_names_value(cfg_file):
    with pytest.raises(ConfigError, match=r"'seed' is not of the form key=value.*seed=VALUE"):
        load_config(cfg_file, ["seed"])
    with pytest.raises(ConfigError, match="bad key"):
        load_config(cfg_file, ["a..b=1"])
    with pytest.raises(ConfigError, match="cannot delete 'nope'"):
        load_config(cfg_file, ["~nope"])
    with pytest.raises(ConfigError, match="already exists; drop the"):
        load_config(cfg_file, ["+seed=1"])


def test_broken_interpolation_and_missing_value_name_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a: ${nowhere}\nb: ???\nc: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.problems[0].startswith("a: cannot resolve interpolation")
    assert e.value.problems[1].startswith("b: required value is not set")
    assert len(e.value.problems) == 2


def test_unknown_builtin_config_lists_known():
    with pytest.raises(ConfigError, match=r"unknown config 'nope'; built-in configs: tiny_cpu"):
        load_config("nope")


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(bad)


def test_instantiate_nested_and_kwargs_override():
    cfg = OmegaConf.create(
        {
            "_component_": "torch.nn.Sequential",
        }
    )
    seq = instantiate(cfg, torch.nn.Identity())
    assert isinstance(seq, torch.nn.Sequential) and len(seq) == 1

    cfg = OmegaConf.create(
        {
            "outer": {
                "_component_": "builtins.dict",
                "inner": {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3},
                "plain": {"a": [1, {"b": 2}]},
                "x": 1,
            }
        }
    )
    out = instantiate(cfg.outer, x=5)
    assert isinstance(out["inner"], torch.nn.Linear) and out["inner"].out_features == 3
    assert out["plain"] == {"a": [1, {"b": 2}]} and type(out["plain"]) is dict
    assert out["x"] == 5  # caller kwargs win over the config


def test_instantiate_positional_args_and_errors():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = instantiate(OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.1}), [p])
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(ConfigError, match=r"opt: unknown keys: opt.lrr \(did you mean lr\?\)"):
        instantiate(
            OmegaConf.create({"opt": {"_component_": "torch.optim.SGD", "lrr": 1}}).opt, [p]
        )
    with pytest.raises(ConfigError, match=r"cannot import 'torch.optim.Sgd'.*torch.optim.SGD"):
        instantiate({"_component_": "torch.optim.Sgd"})
    with pytest.raises(ConfigError, match="no module named 'nopkg'"):
        instantiate({"_component_": "nopkg.thing"})
    with pytest.raises(ConfigError, match="needs a mapping with a _component_"):
        instantiate({"lr": 1})
    assert instantiate(None) is None


def test_validate_reports_every_problem_with_key_path():
    cfg = OmegaConf.create(
        {
            "ok": {"_component_": "torch.nn.Linear", "in_features": 1},
            "typo": {"_component_": "torch.nn.Linear", "in_featurs": 1},
            "gone": {"_component_": "torch.nn.NoSuchLayer"},
            "deep": [{"x": {"_component_": "torch.nn.ReLU", "inplace": True, "bad": 0}}],
        }
    )
    problems = validate(cfg)
    assert len(problems) == 3
    assert problems[0].startswith("typo: unknown keys: typo.in_featurs (did you mean in_features?)")
    assert problems[1].startswith("gone._component_: cannot import 'torch.nn.NoSuchLayer'")
    assert problems[2].startswith("deep[0].x: unknown keys: deep[0].x.bad")


def test_parse_recipe_args_refuses_flags(cfg_file):
    cfg = parse_recipe_args(["--config", str(cfg_file), "seed=9"])
    assert cfg.seed == 9
    with pytest.raises(ConfigError, match=r"config values are set as key=value.*`lr=3`"):
        parse_recipe_args(["--config", str(cfg_file), "--lr=3"])


def test_apply_overrides_in_place():
    cfg = OmegaConf.create({"a": {"b": 1}})
    apply_overrides(cfg, ["a.b=2", "+a.c=[1,2]"])
    assert cfg.a.b == 2 and list(cfg.a.c) == [1, 2]


def test_each_default_is_stated_once_in_the_schema():
    """A key a config may omit has its default in ``ASYNC_PPO_SCHEMA`` and nowhere else: no reader
    in the package, the recipes, the scripts or the benchmarks writes it again as
    ``.get("<key>", <value>)`` or ``select(cfg, "<section.key>", <value>)`` (they read
    ``preflight.setting``), so a default cannot differ between the recipe, ``validate`` and
    ``minippo plan``."""
    import re

    from minippo.config.schema import declared_defaults
    from minippo.training.preflight import ASYNC_PPO_SCHEMA, section, setting

    defaults = declared_defaults(ASYNC_PPO_SCHEMA)
    assert {"rollout.sync_every", "rollout.oversample", "ppo.pack", "parallel.timeout_s"} <= set(
        defaults
    )
    root = Path(__file__).resolve().parents[2]
    files = [
        p for d in ("minippo", "recipes", "scripts", "benchmarks") for p in (root / d).rglob("*.py")
    ]
    found = []
    for key in defaults:
        leaf = re.escape(key.rsplit(".", 1)[-1])
        patterns = [
            re.compile(rf"""\.get\(\s*["']{leaf}["']\s*,"""),
            re.compile(rf"""select\([^)\n]*["']{re.escape(key)}["']\s*,"""),
        ]
        for path in files:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if any(p.search(line) for p in patterns):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "a default written outside the schema:\n" + "\n".join(found)
    # an omitted key reads as its default, a given one as given
    cfg = OmegaConf.create({"rollout": {"sync_every": 3}, "ppo": {"epochs": 2}})
    assert setting(cfg, "rollout.sync_every") == 3 and setting(cfg, "rollout.oversample") == 1.0
    assert section(cfg, "ppo")["pack"] is True and section(cfg, "ppo")["epochs"] == 2
