"""The literal registry of built-in recipes and their configs.

Adding a recipe or a config = adding a line here (a test checks that every registered file exists and
that every file in recipes/ and configs/ is registered).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import minippo
from minippo.config._errors import ConfigError


@dataclass(frozen=True)
class Config:
    name: str
    file_path: str  # relative to configs/
    nproc_per_node: int | None = None  # the launch it is written for (None: a plain process)


@dataclass(frozen=True)
class Recipe:
    name: str
    file_path: str  # relative to recipes/
    configs: tuple[Config, ...]


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="async_ppo",
        file_path="async_ppo.py",
        configs=(
            Config(name="tiny_cpu", file_path="tiny_cpu.yaml"),
            Config(name="tiny_math_cpu", file_path="tiny_math_cpu.yaml"),
            Config(name="tiny_multiturn_cpu", file_path="tiny_multiturn_cpu.yaml"),
            Config(name="tiny_multiturn_tool_cpu", file_path="tiny_multiturn_tool_cpu.yaml"),
            Config(name="tiny_sglang_cpu", file_path="tiny_sglang_cpu.yaml"),
            Config(
                name="qwen3_0_6b_gsm8k_1gpu",
                file_path="qwen3_0_6b_gsm8k_1gpu.yaml",
                nproc_per_node=1,
            ),
            Config(
                name="qwen3_0_6b_synthetic_1gpu",
                file_path="qwen3_0_6b_synthetic_1gpu.yaml",
                nproc_per_node=1,
            ),
            Config(
                name="qwen3_4b_dapo_math_8gpu",
                file_path="qwen3_4b_dapo_math_8gpu.yaml",
                nproc_per_node=8,
            ),
        ),
    ),
    Recipe(
        name="eval",
        file_path="eval.py",
        configs=(Config(name="tiny_eval_cpu", file_path="tiny_eval_cpu.yaml"),),
    ),
)


def builtin_root() -> Path:
    """Folder holding ``recipes/`` and ``configs/``.

    An installed wheel carries them as ``minippo/_builtin/{recipes,configs}``; a source checkout (also
    an editable install) has them at the top of the repository, beside the package.
    """
    package_dir = Path(minippo.__file__).resolve().parent
    shipped = package_dir / "_builtin"
    return shipped if shipped.is_dir() else package_dir.parent


def recipe_names() -> list[str]:
    return [r.name for r in RECIPES]


def config_names() -> list[str]:
    return [c.name for r in RECIPES for c in r.configs]


def get_recipe(name: str) -> Recipe | None:
    return next((r for r in RECIPES if r.name == name), None)


def config_entry(name: str) -> tuple[Recipe, Config] | None:
    """The built-in recipe and config entry of a built-in config name (None for other names)."""
    for recipe in RECIPES:
        for config in recipe.configs:
            if config.name == name:
                return recipe, config
    return None


def builtin_recipe_path(name: str) -> Path:
    recipe = get_recipe(name)
    if recipe is None:
        raise ConfigError(
            f"unknown recipe {name!r}; built-in recipes: {', '.join(recipe_names())} "
            f"(or pass a path to a .py file)"
        )
    return _existing(builtin_root() / "recipes" / recipe.file_path)


def builtin_config_path(name: str) -> Path:
    for recipe in RECIPES:
        for config in recipe.configs:
            if config.name == name:
                return _existing(builtin_root() / "configs" / config.file_path)
    raise ConfigError(
        f"unknown config {name!r}; built-in configs: {', '.join(config_names())} "
        f"(or pass a path to a .yaml file)"
    )


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise ConfigError(
            f"built-in file {str(path)!r} is registered but missing: the installation is broken; "
            f"reinstall minippo (pip install --force-reinstall minippo)"
        )
    return path
