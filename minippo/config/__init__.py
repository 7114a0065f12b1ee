"""Configs: YAML loading, command-line overrides, ``_component_`` instantiation and validation."""

from minippo.config._errors import ConfigError
from minippo.config._instantiate import component_nodes, instantiate, locate, validate
from minippo.config._parse import (
    apply_overrides,
    check_no_flags,
    load_config,
    parse_recipe_args,
    resolve,
    resolve_config_path,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_no_flags",
    "component_nodes",
    "instantiate",
    "load_config",
    "locate",
    "parse_recipe_args",
    "resolve",
    "resolve_config_path",
    "validate",
]
