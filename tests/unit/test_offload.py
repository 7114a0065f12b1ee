"""TrainerOffload on one process: an offload/reload round trip leaves parameters, gradients and
optimizer states bit-identical on their devices and the Parameter objects the same, the storage
really leaves while offloaded, and training continues exactly as without the round trips (torch
AdamW and torchao's quantized states)."""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.parallel import TrainerOffload, reshard_all
from minippo.training.optimizers import build_optimizer

COMPONENTS = [
    "minippo.training.optimizers.AdamW",
    "torchao.optim.AdamW8bit",
    "torchao.optim.AdamW4bit",
]


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    names = t.__tensor_flatten__()[0]  # DTensor also lists its mesh
    return [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, a DTensor's local shard, a torchao
    state's codes, scales and lookup table."""
    if is_traceable_wrapper_subclass(t):
        return [x for y in _inner(t) for x in leaves(y)]
    return [t]


def kind(t: torch.Tensor) -> str:
    """Class names, nested: ``DTensor[OptimState8bit[Tensor, Tensor, Tensor]]``."""
    if is_traceable_wrapper_subclass(t):
        return f"{type(t).__name__}[{', '.join(kind(x) for x in _inner(t))}]"
    return type(t).__name__


def moved_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor TrainerOffload moves, by name: parameters, gradients, optimizer states (whose
    keys must be the model's parameters: a KeyError otherwise). FSDP2 modules are resharded
    first: the sharded parameters are the ones the optimizer holds."""
    reshard_all(model)
    out = {}
    for name, p in model.named_parameters():
        out[name] = p
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad
    names = {id(p): name for name, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(p)]}.{key}"] = value
    return out


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, tuple[str, list]]:
    """{name: (kind, clones of its leaves)} of every moved tensor."""
    return {
        name: (kind(t), [x.detach().clone() for x in leaves(t)])
        for name, t in moved_tensors(model, opt).items()
    }


def data_ptrs(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """{name: data pointer of each non-empty leaf}."""
    return {
        name: [x.data_ptr() for x in leaves(t) if x.numel()]
        for name, t in moved_tensors(model, opt).items()
    }


def storage_refs(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list]:
    """{name: weak reference to the storage of each non-empty leaf}: a reference dies when the
    storage is freed (torch keeps one Python object per live storage)."""
    return {
        name: [weakref.ref(x.untyped_storage()) for x in leaves(t) if x.numel()]
        for name, t in moved_tensors(model, opt).items()
    }


def assert_released(refs: dict[str, list]) -> None:
    gc.collect()
    for name, rs in refs.items():
        assert all(r() is None for r in rs), f"{name}: the old storage is still alive"


def assert_same(a: dict, b: dict) -> None:
    """Two snapshots hold the same classes and bit-identical leaves (dtype, device, shape)."""
    assert a.keys() == b.keys()
    for name, (cls, xs) in a.items():
        cls_b, ys = b[name]
        assert cls == cls_b and len(xs) == len(ys), name
        for x, y in zip(xs, ys, strict=True):
            assert (x.dtype, x.device, x.shape) == (y.dtype, y.device, y.shape), name
            assert torch.equal(x, y), name


def _eager():
    # torchao compiles its step otherwise (a minute of C++ compilation on a fresh machine)
    return torch.compiler.set_stance("force_eager")


def _build(component: str):
    model = init_weights(Transformer(qwen3_tiny()), seed=0)
    node = OmegaConf.create({"_component_": component, "lr": 1e-2})
    return model, build_optimizer(node, model.parameters())


def _backward(model: nn.Module, i: int) -> None:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(i))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    _backward(model, i)
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("component", COMPONENTS)
def test_round_trip_is_bit_identical_and_storage_leaves(component):
    with _eager():
        model, opt = _build(component)
        for i in range(2):
            _step(model, opt, i)
        _backward(model, 2)  # gradients present: they move too
    params = list(model.parameters())
    before, ptrs, refs = snapshot(model, opt), data_ptrs(model, opt), storage_refs(model, opt)
    assert any(name.endswith(".grad") for name in before)
    if "bit" in component:  # some states really are quantized subclasses
        assert any(k.startswith("OptimState") for k, _ in before.values())

    offload = TrainerOffload([(model, opt)])
    assert offload.offload() >= 0.0 and offload.offloaded
    moved = data_ptrs(model, opt)
    # the copies are allocated while the old storages are alive: a moved leaf has a new address
    for name, old in ptrs.items():
        assert all(a != b for a, b in zip(old, moved[name], strict=True)), name
    assert_released(refs)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model.output.weight is model.tok_embeddings.weight  # still tied
    assert_same(snapshot(model, opt), before)  # same values while on the host (here: CPU)

    assert offload.reload() >= 0.0 and not offload.offloaded
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("component", COMPONENTS)
def test_training_continues_exactly(component):
    with _eager():
        (model, opt), (twin, twin_opt) = _build(component), _build(component)
        offload = TrainerOffload([(model, opt)])
        for i in range(4):
            offload.offload()  # the first one before any step (the state as set up)
            offload.reload()
            _step(model, opt, i)
            _step(twin, twin_opt, i)
    assert_same(snapshot(model, opt), snapshot(twin, twin_opt))


def test_repeated_calls_are_noops_and_nbytes_counts_what_moves():
    model, opt = _build("minippo.training.optimizers.AdamW")
    _step(model, opt, 0)
    _backward(model, 1)
    offload = TrainerOffload([(model, opt)])
    assert offload.reload() == 0.0  # not offloaded
    offload.offload()
    ptrs = data_ptrs(model, opt)
    assert offload.offload() == 0.0 and offload.offloaded
    assert data_ptrs(model, opt) == ptrs
    offload.reload()
    assert offload.reload() == 0.0 and not offload.offloaded

    # fp32 parameters, gradients and AdamW's m and v: 4 × 4 bytes per element; a 4-byte step each
    params = list(model.parameters())  # the tied head once
    elements = sum(p.numel() for p in params)
    assert offload.nbytes == 16 * elements + 4 * len(params)


def test_refuses_what_it_cannot_move():
    model, _ = _build("minippo.training.optimizers.AdamW")
    with pytest.raises(TypeError, match=r"SimpleNamespace has no \.state dict.*offload_trainer"):
        TrainerOffload([(model, SimpleNamespace(param_groups=[]))])
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="Sequential has parameters on cpu, meta"):
        TrainerOffload([(split, None)]).offload()
