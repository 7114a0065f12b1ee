"""Activation checkpointing per decoder block (config switch ``activation_checkpointing: true``).

Without it, backward needs every tensor that each block saved during the forward: per block and
token roughly a dozen D- and intermediate-sized vectors (see docs/memory.md). With it, a block keeps
only its input; its backward first re-runs the block's forward (one extra forward of the
blocks, ~1/3 more compute for the training forward+backward) and then frees the recomputed tensors.

Order with FSDP2: apply this first, then ``shard_model`` (``fully_shard`` each block, then the root),
the torchtitan order::

    apply_activation_checkpointing(model)
    shard_model(model, param_dtype=torch.bfloat16)

It uses torch's composable checkpoint (``torch.distributed._composable.checkpoint``, non-reentrant
``torch.utils.checkpoint`` driven by forward hooks), so the module tree is unchanged: parameter
names, ``state_dict`` keys and HF names stay exactly as they were (a wrapper module such as
``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every name), and
``copy.deepcopy`` of the model keeps checkpointing its own blocks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

__all__ = ["apply_activation_checkpointing", "is_activation_checkpointed"]


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every block of ``model.layers``; returns ``model`` (changed in place).

    Works for :class:`~minippo.models.Transformer` and :class:`~minippo.models.ValueModel` (any
    module with an ``nn.ModuleList`` ``.layers``). Call before FSDP2 sharding; calling it twice is
    an error (a block would be recomputed twice).
    """
    layers = unsharded_blocks(model, "apply_activation_checkpointing")
    for i, block in enumerate(layers):
        if is_activation_checkpointed(block):
            raise RuntimeError(
                f"layers.{i} is already activation-checkpointed; apply_activation_checkpointing "
                "was called twice on this model"
            )
        checkpoint(block)
    return model


def unsharded_blocks(model: nn.Module, caller: str) -> nn.ModuleList:
    """``model.layers``, checked for what a per-block transform (activation checkpointing,
    compiling) needs: a non-empty ``nn.ModuleList`` not yet sharded by FSDP2. Errors name
    ``caller``."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(
            f"{caller} expects a model with a non-empty nn.ModuleList .layers (a Transformer or "
            f"ValueModel), got {type(model).__name__}"
        )
    if any(type(block).__name__.startswith("FSDP") for block in layers):
        raise RuntimeError(
            f"{caller} must run before FSDP2 sharding (shard_model / fully_shard): call it on "
            "the unsharded model"
        )
    return layers


def is_activation_checkpointed(module: nn.Module) -> bool:
    """True when ``module`` itself runs under composable activation checkpointing."""
    try:
        return checkpoint.state(module) is not None
    except Exception:  # no state registered
        return False
