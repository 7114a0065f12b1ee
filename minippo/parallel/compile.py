"""``torch.compile`` per decoder block (config switch ``compile: true``).

On small and medium models a training step is dominated by the dispatch of many small element-wise
ops (RMSNorm, RoPE, SiLU, residual adds, their backward): each costs ~10-20 µs of framework time
whatever its size. Compiling each decoder block fuses them into a few generated kernels, forward
and backward (AOTAutograd), while the matmuls stay library calls. The block's own ``compile()``
is used, so the module tree, parameter names and ``state_dict`` keys stay exactly as they were
(``torch.compile(module)`` would wrap it and prefix every name with ``_orig_mod``).

Order, as torchtitan: activation checkpointing, then compile, then FSDP2::

    apply_activation_checkpointing(model)   # optional
    compile_blocks(model)
    shard_model(model)

Costs and limits: the first forward of each shape and grad mode compiles (tens of seconds per
model on a CPU, once per process; a second sequence length recompiles once with dynamic shapes).
Results equal the eager model's up to float rounding (fusion reorders a few reductions), not bit
for bit.
"""

from __future__ import annotations

from torch import nn

from minippo.parallel.activation_checkpointing import unsharded_blocks

__all__ = ["compile_blocks", "is_compiled"]


def compile_blocks(model: nn.Module) -> nn.Module:
    """``compile()`` every block of ``model.layers`` in place; returns ``model``.

    For :class:`~minippo.models.Transformer` and :class:`~minippo.models.ValueModel` (any module
    with a non-empty ``nn.ModuleList`` ``.layers``). Call before FSDP2 sharding, once.
    """
    for i, block in enumerate(unsharded_blocks(model, "compile_blocks")):
        if is_compiled(block):
            raise RuntimeError(f"layers.{i} is already compiled; compile_blocks was called twice")
        block.compile(dynamic=None)
    return model


def is_compiled(module: nn.Module) -> bool:
    """True when ``module.compile()`` has been called on ``module`` itself."""
    return getattr(module, "_compiled_call_impl", None) is not None
