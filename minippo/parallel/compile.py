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

What compiles, and how often. torch.compile caches graphs per *code object*, not per module: the
blocks of every model of the process (actor, reference, critic) share ``TransformerBlock.forward``
and its cache, which holds at most ``torch._dynamo.config.recompile_limit`` (8) graphs; past it,
every further variant runs eagerly, silently but for one warning. So a block's forward reads no
per-layer Python state (an int attribute such as a layer index is a constant to the compiler:
one graph per block, and a 12-layer model hit the limit), and its sizes are dynamic from the first
call (``dynamic=True``: no static graph for the first shape followed by a dynamic one). One graph
is then compiled per distinct

* grad mode (training forward / no-grad scoring),
* attention path: causal (no padding), padded (an additive mask), packed (the bucketed
  attention runs eagerly between two compiled parts, each cached on its own code object),
* block kind: its weights' shapes and dtype (a critic of another size than the actor adds graphs;
  a critic, actor or reference of the same size reuses them),

whatever the depth, the batch size or the sequence length (sizes of 1 aside: the compiler
specialises them). A run with one model size and one attention path thus compiles 2 graphs per
code object; :func:`compilation_count` reports the totals. Each costs seconds to tens of seconds on
a CPU, once per process. Results equal the eager model's up to float rounding (fusion reorders a
few reductions), not bit for bit.
"""

from __future__ import annotations

import torch._dynamo.utils
from torch import nn

from minippo.parallel.activation_checkpointing import unsharded_blocks

__all__ = ["compilation_count", "compile_blocks", "is_compiled"]


def compile_blocks(model: nn.Module, *, backend: str = "inductor") -> nn.Module:
    """``compile()`` every block of ``model.layers`` in place; returns ``model``.

    For :class:`~minippo.models.Transformer` and :class:`~minippo.models.ValueModel` (any module
    with a non-empty ``nn.ModuleList`` ``.layers``). Call before FSDP2 sharding, once.
    ``backend``: the ``torch.compile`` backend; ``"aot_eager"`` traces the same graphs (the same
    guards, so the same recompiles) without generating code, for tests and debugging.
    """
    for i, block in enumerate(unsharded_blocks(model, "compile_blocks")):
        if is_compiled(block):
            raise RuntimeError(f"layers.{i} is already compiled; compile_blocks was called twice")
        block.compile(dynamic=True, backend=backend)
    return model


def is_compiled(module: nn.Module) -> bool:
    """True when ``module.compile()`` has been called on ``module`` itself."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compilation_count() -> dict[str, int]:
    """What ``torch.compile`` has done so far in this process (every compiled function, the blocks
    of :func:`compile_blocks` and the engine's decode step alike), from Dynamo's counters:

    * ``graphs``: graphs compiled (each a trace handed to Inductor; a graph break splits one
      frame into two graphs);
    * ``frames``: frames converted (a first compile or a recompile of a function);
    * ``eager_frames``: frames Dynamo gave up on, which run eagerly from then on: a recompile
      limit hit (``torch._dynamo.config.recompile_limit``) or an error in tracing. 0 in a
      healthy run.

    Read it before and after a phase (the counters are process-wide and only grow) to see what
    the phase compiled.
    """
    frames = torch._dynamo.utils.counters["frames"]
    return {
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "frames": frames["ok"],
        "eager_frames": frames["total"] - frames["ok"],
    }
