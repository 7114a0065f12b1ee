"""Simulated low-precision rollouts: the engine samples from FP8, int8 or int4 rounded weights
(and FP8 activations) while the trainer scores in its own precision.

Production engines often serve rollouts in FP8 (weights per output channel, activations per
token, both scaled to the format's range) or int8 / int4 weight-only; the trainer then computes the
anchor logprobs in bf16/fp32, and the two disagree by 1e-2 nats per token or more. This module
reproduces that gap on any device by rounding *in place* to the format and back ("fake
quantization"): the arithmetic stays in the engine's compute dtype, only the values are those a
quantized kernel would see. It is what ``engine.quantize`` (TorchEngine) applies after every
weight publish and around every linear layer.

    fake_quantize(w, "fp8")             # per-row absmax scale to E4M3's 448, round, scale back
    quantize_linear_weights_(model, "int8")
    handles = quantize_linear_inputs(model, "fp8")   # per-token activations; h.remove() undoes

Formats:
    fp8       float8 E4M3 (max 448): weights per output channel and activations per token,
              as FP8 W8A8 serving does.
    int8      symmetric int8 (max 127), weights per output channel only (weight-only int8;
              activations are left alone).
    int4      symmetric int4 (codes -7..7), weights only, one scale per group of 32 inputs
              of an output channel (W4A16, as AWQ / GPTQ checkpoints are served).

What is rounded: every linear layer's weight (attention and MLP projections) except the output
layer (``lm_head``, which FP8 serving keeps in high precision and which a tied model shares with
the embedding). Embeddings and norms are never rounded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "QUANT_FORMATS",
    "check_quant_format",
    "fake_quantize",
    "quantize_linear_inputs",
    "quantize_linear_weights_",
]

QUANT_FORMATS = ("fp8", "int8", "int4")
_FLOAT8 = {"fp8": torch.float8_e4m3fn}  # float8 formats (E4M3's largest finite value: 448)
_INT_MAX = {"int8": 127.0, "int4": 7.0}  # symmetric integer codes -qmax..qmax
INT4_GROUP = 32  # int4 shares one scale per this many consecutive inputs (W4A16 group size)


def check_quant_format(fmt: str | None) -> str | None:
    """``fmt`` if it is ``None`` or one of :data:`QUANT_FORMATS`; else a ValueError naming the
    config key."""
    if fmt is None or fmt in QUANT_FORMATS:
        return fmt
    raise ValueError(
        f"engine.quantize must be null or one of {list(QUANT_FORMATS)}, got {fmt!r}: "
        "e.g. engine.quantize=fp8"
    )


@torch.no_grad()
def fake_quantize(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """``t`` rounded to ``fmt`` with one absmax scale per row (the last dimension shares a
    scale; for int4, each group of :data:`INT4_GROUP` consecutive entries of a row, when the
    row divides into them) and returned in ``t``'s dtype. A row of zeros stays zeros."""
    check_quant_format(fmt)
    x = t.float()
    if fmt == "int4" and x.shape[-1] % INT4_GROUP == 0:
        x = x.unflatten(-1, (-1, INT4_GROUP))
    amax = x.abs().amax(dim=-1, keepdim=True)
    f8 = _FLOAT8.get(fmt)
    qmax = torch.finfo(f8).max if f8 is not None else _INT_MAX[fmt]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if f8 is not None:
        q = (x / scale).clamp(-qmax, qmax).to(f8).float()
    else:
        q = torch.round(x / scale).clamp(-qmax, qmax)
    return (q * scale).reshape(t.shape).to(t.dtype)


def _quantized_linears(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The modules with a 2-D ``weight`` that act as linear layers, the output layer excluded."""
    output = getattr(model, "output", None)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if module is output or isinstance(module, nn.Embedding):
            continue
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            yield name, module


@torch.no_grad()
def quantize_linear_weights_(model: nn.Module, fmt: str) -> int:
    """Round every linear weight of ``model`` (the output layer excluded) to ``fmt`` in place;
    returns how many were rounded."""
    n = 0
    for _, module in _quantized_linears(model):
        module.weight.copy_(fake_quantize(module.weight, fmt))
        n += 1
    return n


def quantize_linear_inputs(model: nn.Module, fmt: str) -> list[torch.utils.hooks.RemovableHandle]:
    """With a float8 ``fmt``, round the input of every linear layer (the output layer excluded)
    per token before it runs; returns the hook handles (``remove()`` undoes). ``int8`` and
    ``int4`` are weight-only: no hooks, an empty list."""
    check_quant_format(fmt)
    if fmt not in _FLOAT8:
        return []

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (fake_quantize(args[0], fmt), *args[1:])

    return [module.register_forward_pre_hook(hook) for _, module in _quantized_linears(model)]
