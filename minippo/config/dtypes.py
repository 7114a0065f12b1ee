"""The one map of dtype names used by configs: ``dtype``, ``engine.dtype``, ``correction.storage_dtype``.

Both spellings are accepted everywhere (``bf16`` and ``bfloat16``, ``fp32`` and ``float32``, ...).
torch is imported only when a ``torch.dtype`` is asked for, so the CLI stays quick to start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minippo.config._errors import ConfigError

if TYPE_CHECKING:
    import torch

# name -> canonical torch name
DTYPE_NAMES: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def canonical_dtype(name: object, key: str = "dtype") -> str:
    """``"bf16"`` -> ``"bfloat16"``; a ConfigError naming ``key`` for an unknown name."""
    canonical = DTYPE_NAMES.get(str(name))
    if canonical is None:
        raise ConfigError(
            f"{key}={name!r} is not a dtype; use one of {', '.join(sorted(DTYPE_NAMES))}"
        )
    return canonical


def torch_dtype(name: object, key: str = "dtype") -> torch.dtype:
    """The ``torch.dtype`` of a config dtype name (either spelling)."""
    import torch

    return getattr(torch, canonical_dtype(name, key))


def dtype_bytes(name: object, key: str = "dtype") -> int:
    """Bytes per element of a config dtype name."""
    return DTYPE_BYTES[canonical_dtype(name, key)]
