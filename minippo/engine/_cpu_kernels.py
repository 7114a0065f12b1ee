"""oneDNN's packed linear kernel for TorchEngine's private model on CPU (a decode-speed detail).

For the decode shapes (a few dozen rows) ``F.linear`` reorders the weight into oneDNN's blocked
layout on every call; packing it once per publish runs the matmuls up to about twice as fast with
the same math (docs/benchmarks.md). This relies on private ``torch.ops.mkldnn`` ops, so it is
used only where :func:`onednn_linear_available` says they exist.

Under ``torch.compile`` (the engine's ``compile=True`` decode step) the packed weight, an opaque
oneDNN tensor that dynamo cannot trace, stays outside the graph: the layer calls the custom op
``minippo::packed_linear(x, weight, bias)``, which finds the packed copy of ``weight`` (by its
storage address) at run time. The compiled graph thus holds no weight values: publishes, which
copy into the parameters in place and repack, and sleep / wake need no recompilation.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

# data_ptr of a PackedLinear's weight -> the layer (the custom op's way to its packed copy)
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the packed copy of ``weight`` (a :class:`PackedLinear`'s)."""
    layer = _LAYERS.get(weight.data_ptr())
    if layer is None or layer.packed is None:
        raise RuntimeError("packed_linear: no packed copy of this weight (engine asleep?)")
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")


# registered with torch.library.Library rather than @custom_op: a plain CPU kernel is called with
# about the overhead of the direct call (~20 us less per call, x 7 linears per layer per step)
_LIB = torch.library.Library("minippo", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("minippo::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear kernel can run on ``device`` in ``dtype``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """An ``nn.Linear``'s own parameters, applied with oneDNN's packed CPU kernel.

    The weight is reordered once into oneDNN's blocked layout (``repack()``, after every weight
    change) instead of on every call. The parameters stay the module's ``weight`` / ``bias``, so
    names and publishes are unchanged.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.repack()
        _LAYERS[self.weight.data_ptr()] = self

    def repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def drop(self) -> None:
        """Free the packed copy (the engine sleeps); ``repack()`` restores it."""
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""
        if torch.compiler.is_compiling():
            return torch.ops.minippo.packed_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> list[PackedLinear]:
    """Replace every ``nn.Linear`` of ``model`` (the engine's private model) by a
    :class:`PackedLinear` sharing its parameters; return them (call ``repack()`` after loading
    new weights). Needs :func:`onednn_linear_available` for the model's device and dtype."""
    packed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = PackedLinear(child)
                setattr(parent, name, new)
                packed.append(new)
    return packed
