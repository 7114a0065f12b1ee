"""The ``sglang_cpu`` lane: the real SGLang 0.5.23 engine on this CPU, through SGLangEngine.

Runs in the environment ``scripts/sglang_cpu_env.sh VENV_DIR`` builds (``VENV_DIR/bin/python -m
pytest -m sglang_cpu``); the default suite deselects it (pyproject's ``-m``). Run without that
environment, every test of the lane fails with one line that says how to build it: a lane that
skips itself would pass without testing anything.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from minippo.models import qwen3_tiny
from minippo.models.hf_checkpoint import hf_config_from_model_args

ARGS = qwen3_tiny()
_PORTS = itertools.count(31000, 16)  # one port pair per engine this process starts


def next_base_port() -> int:
    """A base_port no other engine of this test process uses (engines may be alive together)."""
    return next(_PORTS)


@pytest.fixture(scope="session", autouse=True)
def real_sglang() -> None:
    missing = [m for m in ("sglang", "sgl_kernel") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(
            f"the sglang_cpu lane needs the real SGLang engine ({', '.join(missing)} not "
            "importable here): bash scripts/sglang_cpu_env.sh VENV_DIR, then "
            "VENV_DIR/bin/python -m pytest -m sglang_cpu",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> str:
    """An HF folder with the config.json of the tiny Qwen3 (no weights: load_format dummy)."""
    folder = Path(tmp_path_factory.mktemp("tiny-qwen3"))
    (folder / "config.json").write_text(json.dumps(hf_config_from_model_args(ARGS)))
    return str(folder)
