"""Configs: YAML loading, command-line overrides, ``_component_`` instantiation, validation
(``minippo.config.schema``: declared keys, types and ranges) and one-line error reports."""

from minippo.config._errors import ConfigError
from minippo.config._instantiate import component_nodes, instantiate, locate, validate
from minippo.config._parse import (
    apply_overrides,
    check_no_flags,
    expand_home,
    load_config,
    parse_recipe_args,
    resolve,
    resolve_config_path,
)
from minippo.config._report import report_error, run_recipe
from minippo.config.dtypes import DTYPE_NAMES, canonical_dtype, dtype_bytes, torch_dtype

__all__ = [
    "DTYPE_NAMES",
    "ConfigError",
    "apply_overrides",
    "canonical_dtype",
    "check_no_flags",
    "component_nodes",
    "dtype_bytes",
    "expand_home",
    "instantiate",
    "load_config",
    "locate",
    "parse_recipe_args",
    "report_error",
    "resolve",
    "resolve_config_path",
    "run_recipe",
    "torch_dtype",
    "validate",
]
