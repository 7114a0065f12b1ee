"""The minippo CLI: ls, cp, run, validate (in-process and through the real console entry)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minippo._cli import registry
from minippo._cli.main import main
from tests.helpers import minippo_here

CLI = [sys.executable, "-m", "minippo"]

RECIPE = textwrap.dedent(
    """\
    import json, os, sys
    from minippo.config import parse_recipe_args
    from omegaconf import OmegaConf

    cfg = parse_recipe_args()
    rank = os.environ.get("RANK", "none")
    out = os.path.join(cfg.output_dir, f"rank_{rank}.json")
    with open(out, "w") as f:
        json.dump(OmegaConf.to_container(cfg), f)
    print("recipe ran on rank", rank)
    """
)


@pytest.fixture
def local_recipe(tmp_path):
    recipe = tmp_path / "echo_recipe.py"
    recipe.write_text(RECIPE)
    cfg = tmp_path / "echo.yaml"
    cfg.write_text(f"output_dir: {tmp_path}\nseed: 1\nnested:\n  lr: 0.1\n")
    return recipe, cfg


@pytest.fixture
def fake_builtins(tmp_path, monkeypatch):
    root = tmp_path / "builtin"
    (root / "recipes").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "recipes" / "async_ppo.py").write_text("# recipe\n")
    for recipe in registry.RECIPES:
        for c in recipe.configs:
            (root / "configs" / c.file_path).write_text(f"# {c.name}\nseed: 0\n")
    monkeypatch.setattr(registry, "builtin_root", lambda: root)
    return root


def run_cli(*args, cwd=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_ls_prints_recipe_config_table(capsys):
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RECIPE", "CONFIG"]
    assert lines[1].split() == ["async_ppo", "tiny_cpu"]
    listed = {line.split()[-1] for line in lines[1:]}
    assert listed == set(registry.config_names())


def test_help_shows_examples():
    out = run_cli("--help").stdout
    assert "minippo run async_ppo --config tiny_cpu" in out
    assert "minippo run async_ppo --config tiny_cpu" in run_cli("run", "--help").stdout
    assert "minippo cp tiny_cpu" in run_cli("cp", "--help").stdout
    assert "minippo validate --config tiny_cpu" in run_cli("validate", "--help").stdout


def test_cp_copies_and_refuses_to_overwrite(fake_builtins, tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert main(["cp", "tiny_cpu", str(dest)]) == 0
    assert dest.read_text() == (fake_builtins / "configs" / "tiny_cpu.yaml").read_text()

    dest.write_text("edited\n")
    assert main(["cp", "tiny_cpu", str(dest)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert dest.read_text() == "edited\n"

    assert main(["cp", "tiny_cpu", str(dest), "--no-clobber"]) == 0
    assert dest.read_text() == "edited\n"

    assert main(["cp", "tiny_cpu", str(dest), "--force"]) == 0
    assert dest.read_text().startswith("# tiny_cpu")


def test_cp_suffix_folder_and_unknown(fake_builtins, tmp_path, capsys):
    assert main(["cp", "async_ppo", str(tmp_path / "my_recipe")]) == 0
    assert (tmp_path / "my_recipe.py").read_text() == "# recipe\n"
    folder = tmp_path / "cfgs"
    folder.mkdir()
    assert main(["cp", "tiny_cpu", str(folder)]) == 0
    assert (folder / "tiny_cpu.yaml").exists()
    assert main(["cp", "nope", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe or config 'nope'" in err and "async_ppo" in err and "tiny_cpu" in err
    assert main(["cp", "tiny_cpu", str(tmp_path / "no" / "such" / "x.yaml")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err


def test_run_local_recipe_with_overrides(local_recipe, tmp_path):
    recipe, cfg = local_recipe
    res = run_cli("run", str(recipe), "--config", str(cfg), "seed=5", "+extra=x", "~nested")
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "rank_none.json").read_text())
    assert out == {"output_dir": str(tmp_path), "seed": 5, "extra": "x"}


def test_run_refuses_flags_after_recipe(local_recipe):
    recipe, cfg = local_recipe
    res = minippo_here("run", str(recipe), "--config", str(cfg), "--seed", "3")
    assert res.returncode == 2
    assert "config values are set as key=value" in res.stderr and "`seed=3`" in res.stderr


def test_run_unknown_names_list_known(local_recipe):
    _, cfg = local_recipe
    res = minippo_here("run", "no_such_recipe", "--config", str(cfg))
    assert res.returncode == 2 and "built-in recipes: async_ppo" in res.stderr
    recipe, _ = local_recipe
    res = minippo_here("run", str(recipe), "--config", "no_such_config")
    assert res.returncode == 2 and "built-in configs: tiny_cpu" in res.stderr
    res = minippo_here("run", str(recipe))
    assert res.returncode == 2 and "missing --config" in res.stderr


def test_run_bad_override_fails_before_recipe(local_recipe, tmp_path):
    recipe, cfg = local_recipe
    res = minippo_here("run", str(recipe), "--config", str(cfg), "sead=1")
    assert res.returncode == 2 and "unknown config key 'sead'" in res.stderr
    assert not list(tmp_path.glob("rank_*.json"))


def test_run_through_torchrun(local_recipe, tmp_path):
    recipe, cfg = local_recipe
    res = run_cli(
        "run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        str(recipe),
        "--config",
        str(cfg),
        "seed=4",
    )
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank_{rank}.json").read_text())["seed"] == 4


def test_validate_ok_and_problems(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("opt:\n  _component_: torch.optim.SGD\n  lr: 0.1\n")
    res = minippo_here("validate", "--config", str(good))
    assert res.returncode == 0 and "well-formed" in res.stdout
    res = minippo_here("validate", "--config", str(good), "opt.momentum=0.9")
    assert res.returncode == 1 and "unknown config key 'opt.momentum'" in res.stderr
    res = minippo_here("validate", "--config", str(good), "+opt.momentun=0.9", "+x._component_=a.b")
    assert res.returncode == 1
    assert "opt: unknown keys: opt.momentun (did you mean momentum?)" in res.stderr
    assert "x._component_: cannot import 'a.b'" in res.stderr


def test_recipes_folder_is_not_importable():
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", "import recipes"], cwd=root, capture_output=True, text=True
    )
    assert res.returncode != 0 and "not an importable package" in res.stderr


def test_registry_matches_files():
    root = Path(__file__).resolve().parents[2]
    assert registry.builtin_root() == root  # a source checkout uses the top-level folders
    registered = {c.file_path for r in registry.RECIPES for c in r.configs}
    assert registered == {p.name for p in (root / "configs").glob("*.yaml")}
    assert {r.file_path for r in registry.RECIPES} == {
        p.name for p in (root / "recipes").glob("*.py") if p.name != "__init__.py"
    }
