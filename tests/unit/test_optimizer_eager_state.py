"""Optimizer state from setup (``build_optimizer`` → ``materialize_state``): it exists before the
first step, it is the fresh state the first step would create, and training from it gives the same
parameters and states, bit for bit, as a lazily created state (torch AdamW fused and foreach,
torchao AdamW8bit and AdamW4bit; FSDP2 DTensor parameters in
tests/distributed/test_optimizer_eager_state_fsdp.py)."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from minippo.config import instantiate
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.training.optimizers import build_optimizer, materialize_state

# (component, the options build_optimizer adds on CPU that the lazy twin must get too)
CASES = [
    ("minippo.training.optimizers.AdamW", {}),
    ("torch.optim.AdamW", {"foreach": True}),
    ("torchao.optim.AdamW8bit", {}),
    ("torchao.optim.AdamW4bit", {}),
]
_BATCHES = [
    torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(i)) for i in range(4)
]


def _node(component: str):
    return OmegaConf.create({"_component_": component, "lr": 1e-2, "weight_decay": 0.1})


def _model() -> Transformer:
    return init_weights(Transformer(qwen3_tiny()), seed=0)


def train(model, opt, batches=_BATCHES) -> None:
    for tokens in batches:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer state, torchao's quantized states as codes, scales, tables;
    DTensors as their local shard."""
    out = []
    for state in opt.state.values():
        for key in sorted(state):
            t = state[key]
            t = t.to_local() if type(t).__name__ == "DTensor" else t
            attrs = getattr(t, "tensor_attrs", None)
            out += [getattr(t, a) for a in attrs] if attrs else [t]
    return out


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(("component", "extra"), CASES)
def test_state_exists_at_setup_and_trains_bit_for_bit_as_lazy(component, extra):
    with torch.compiler.set_stance("force_eager"):
        eager_model, lazy_model = _model(), _model()
        eager = build_optimizer(_node(component), eager_model.parameters())
        lazy = instantiate(_node(component), lazy_model.parameters(), **extra)
        assert not lazy.state
        params = list(eager_model.parameters())
        assert len(eager.state) == len(params)
        assert all(p.grad is None for p in params)
        for state in eager.state.values():
            assert float(state["step"]) == 0.0
        # the parameters are untouched by the zero step that made the state
        for p, q in zip(params, lazy_model.parameters()):
            assert torch.equal(p, q)
        train(eager_model, eager)
        train(lazy_model, lazy)
    for p, q in zip(eager_model.parameters(), lazy_model.parameters()):
        assert torch.equal(p, q), component
    assert_bitwise(state_tensors(eager), state_tensors(lazy))


def test_materialized_state_equals_the_first_steps_own_initialisation():
    """The fresh torchao 8-bit state: zero codes and scales beside the lookup table, as
    ``OptimState8bit.zeros`` makes it (a zero step alone leaves scales of 1e-12 or so)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    with torch.compiler.set_stance("force_eager"):
        opt = build_optimizer(_node("torchao.optim.AdamW8bit"), _model().parameters())
    w = _model().layers[0].feed_forward.w1.weight
    for p, state in zip(opt.param_groups[0]["params"], opt.state.values()):
        if p.shape != w.shape:
            continue
        fresh = OptimState8bit.zeros(p.shape, signed=True, block_size=256)
        m = state["exp_avg"]
        assert type(m) is OptimState8bit
        assert_bitwise([m.codes, m.scale, m.qmap], [fresh.codes, fresh.scale, fresh.qmap])
        return
    raise AssertionError("no w1 parameter found")


def test_materialize_state_keeps_an_existing_state():
    model = _model()
    opt = instantiate(_node("minippo.training.optimizers.AdamW"), model.parameters())
    train(model, opt, _BATCHES[:1])
    before = [t.clone() for t in state_tensors(opt)]
    materialize_state(opt)
    assert_bitwise(state_tensors(opt), before)


def test_an_unknown_optimizer_keeps_its_lazy_state_and_says_so(caplog):
    with caplog.at_level("WARNING", logger="minippo.training.optimizers"):
        opt = build_optimizer(
            OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}),
            _model().parameters(),
        )
    assert not opt.state
    assert "torch.optim.SGD: its state is created at its first step" in caplog.text
