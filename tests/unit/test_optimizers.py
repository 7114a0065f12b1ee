"""Optimizer choices: each trains the tiny model, resumes exactly through DCP (low-bit states
included), and the planner's byte count of its state equals what it really allocates.

torchao's low-bit optimizers run their per-parameter step through ``torch.compile`` (inductor C++
kernels on CPU: about a minute of compilation on a cold cache). The default tests run that same
step eagerly with ``torch.compiler.set_stance("force_eager")``; the compiled path is covered by the
slow tests.
"""

import contextlib
import math
import os
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from benchmarks._common import TensorMemoryTracker
from minippo.config import ConfigError, instantiate, load_config
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.training.checkpoint import Checkpointer
from minippo.training.metrics import read_jsonl
from minippo.training.optimizers import (
    OPTIMIZER_SPECS,
    AdamW,
    build_optimizer,
    local_numel,
    optimizer_spec,
    optimizer_state_bytes,
)
from tests.helpers import run_on_ranks

COMPONENTS = [
    "minippo.training.optimizers.AdamW",
    "torchao.optim.AdamW8bit",
    "torchao.optim.AdamW4bit",
]


def _eager():
    return torch.compiler.set_stance("force_eager")


def _node(component: str, **kw):
    return OmegaConf.create({"optimizer": {"_component_": component, "lr": 1e-2, **kw}}).optimizer


def _model() -> Transformer:
    torch.manual_seed(0)
    return init_weights(Transformer(qwen3_tiny()), seed=0)


_BATCH = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))


def _step(model, opt) -> float:
    tokens = _BATCH
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _state_bytes(opt) -> int:
    """Bytes of every storage the optimizer state holds (quantized subclasses: codes + scales +
    lookup tables)."""
    return TensorMemoryTracker().track(opt).current.get("cpu", 0)


def test_components_instantiate_from_config_with_params_positional():
    for comp in COMPONENTS:
        model = _model()
        opt = instantiate(_node(comp, weight_decay=0.0), model.parameters())
        assert opt.param_groups[0]["weight_decay"] == 0.0
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2)
        assert type(opt).__name__ == comp.rsplit(".", 1)[-1]


def test_adamw_is_fused_on_cpu_and_betas_from_a_yaml_list():
    opt = build_optimizer(
        _node("minippo.training.optimizers.AdamW", betas=[0.9, 0.95]), _model().parameters()
    )
    assert opt.defaults["fused"] is True
    assert opt.defaults["betas"] == (0.9, 0.95)
    assert AdamW(_model().parameters(), fused=False).defaults["fused"] is False


def test_torch_adamw_on_cpu_takes_foreach_with_the_same_weights():
    """build_optimizer gives torch.optim.AdamW foreach=True on CPU when the node leaves it unset;
    the weights after a few steps equal the per-tensor loop's bit for bit."""
    models, opts = [], []
    for extra in ({}, {"foreach": False}):
        model = _model()
        opt = build_optimizer(
            _node("torch.optim.AdamW", weight_decay=0.1, **extra), model.parameters()
        )
        models.append(model)
        opts.append(opt)
    assert opts[0].defaults["foreach"] is True and opts[1].defaults["foreach"] is False
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in models[0].parameters()]
        for model, opt in zip(models, opts):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(models[0].parameters()), next(_model().parameters()))


def test_build_optimizer_errors_name_the_problem():
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer(_node("torch.optim.AdamW"), [])
    with pytest.raises(ConfigError, match="_component_"):
        build_optimizer(OmegaConf.create({"lr": 1.0}), _model().parameters())
    with pytest.raises(ConfigError, match=r"did you mean torchao\.optim\.AdamW8bit"):
        build_optimizer(_node("torchao.optim.AdamW8bits"), _model().parameters())


@pytest.mark.parametrize("component", COMPONENTS)
def test_state_bytes_formula_matches_the_real_optimizer(component):
    model = _model()
    with _eager():  # build_optimizer creates the state with one (zero) step
        opt = build_optimizer(_node(component), model.parameters())
        _step(model, opt)
    spec, minimal = optimizer_spec(_node(component))
    numels = [p.numel() for p in model.parameters()]
    fused = component.startswith("minippo")
    predicted = optimizer_state_bytes(
        spec, numels, param_bytes=4, minimal_size=minimal, step_on_device=fused
    )
    assert predicted.device + predicted.host == _state_bytes(opt)
    if spec.bits:  # the large matrices really are quantized
        w1 = opt.state[model.layers[0].feed_forward.w1.weight]["exp_avg"]
        assert type(w1).__name__ == f"OptimState{spec.bits}bit"


def test_state_bytes_per_parameter_ratios():
    n = 4096 * 1024
    fp32 = optimizer_state_bytes(OPTIMIZER_SPECS["torch.optim.AdamW"], [n], param_bytes=4)
    b8 = optimizer_state_bytes(OPTIMIZER_SPECS["torchao.optim.AdamW8bit"], [n], param_bytes=4)
    b4 = optimizer_state_bytes(OPTIMIZER_SPECS["torchao.optim.AdamW4bit"], [n], param_bytes=4)
    assert fp32.device - 4 == 8 * n
    # 2 × (1 + 4/256) bytes and 2 × (1/2 + 4/128) bytes per element, + lookup tables + step
    assert b8.device + b8.host == 2 * (n + 4 * n // 256 + 4 * 256) + 4
    assert b4.device + b4.host == 2 * (n // 2 + 4 * n // 128 + 4 * 16) + 4
    spec, minimal = optimizer_spec(
        {"_component_": "minippo.training.optimizers.CPUOffload", "optimizer": "torch.optim.AdamW"}
    )
    off = optimizer_state_bytes(spec, [n, 10], param_bytes=4, minimal_size=minimal)
    assert off.host == 8 * n + 4 + 8 * n and off.device == 8 * 10 + 4


def test_local_numel_follows_fsdp2_dim0_chunks():
    assert local_numel((10, 3), 4, 0) == 9  # ceil(10/4) = 3 rows
    assert local_numel((10, 3), 4, 3) == 3  # rows 9..9
    assert local_numel((2, 3), 4, 3) == 0
    assert sum(local_numel((10, 3), 4, r) for r in range(4)) == 30


def test_planner_refuses_unknown_optimizer_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"torchao\.optim\.AdamW8bit"):
        optimizer_spec({"_component_": "torch.optim.SGD"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cpu_offload_needs_cuda_and_says_so():
    node = _node("minippo.training.optimizers.CPUOffload", optimizer="torchao.optim.AdamW8bit")
    with pytest.raises(RuntimeError, match="needs a CUDA"):
        build_optimizer(node, _model().parameters())


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torchao.optim.CPUOffloadOptimizer requires CUDA or XPU (it asserts an accelerator)",
)
@pytest.mark.gpu
def test_cpu_offload_trains_on_cuda():
    model = _model().cuda()
    opt = build_optimizer(_node("minippo.training.optimizers.CPUOffload"), model.parameters())
    global _BATCH
    old, _BATCH = _BATCH, _BATCH.cuda()
    try:
        losses = [_step(model, opt) for _ in range(8)]
    finally:
        _BATCH = old
    assert losses[-1] < 0.8 * losses[0]


def _train_and_resume(component: str, tmp_path, compiled: bool) -> None:
    """4 steps (the loss must fall), checkpoint after step 2; a fresh model and optimizer loaded
    from that checkpoint must reproduce steps 3 and 4 exactly."""
    ctx = contextlib.nullcontext() if compiled else _eager()
    with ctx:
        model = _model()
        opt = build_optimizer(_node(component), model.parameters())
        losses = [_step(model, opt) for _ in range(2)]
        ckpt = Checkpointer(tmp_path / "ckpt")
        ckpt.save(2, models={"actor": (model, opt)}, states={})
        losses += [_step(model, opt) for _ in range(2)]

        model2 = _model()  # fresh weights and an optimizer without state
        opt2 = build_optimizer(_node(component), model2.parameters())
        ckpt.load(ckpt.resolve("latest"), models={"actor": (model2, opt2)}, states={})
        resumed = [_step(model2, opt2) for _ in range(2)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert resumed == losses[2:]
    w1, w1_resumed = model.layers[0].feed_forward.w1.weight, model2.layers[0].feed_forward.w1.weight
    kind = type(opt.state[w1]["exp_avg"]).__name__
    assert type(opt2.state[w1_resumed]["exp_avg"]).__name__ == kind
    bits = optimizer_spec(_node(component))[0].bits
    assert kind == (f"OptimState{bits}bit" if bits else "Tensor")


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_optimizer_trains_and_resumes_identically_through_dcp(component, tmp_path):
    _train_and_resume(component, tmp_path, compiled=False)


@pytest.mark.slow
@pytest.mark.parametrize("component", COMPONENTS[1:])
def test_compiled_torchao_step_trains_and_resumes(component, tmp_path):
    """The real (torch.compile'd) torchao step; ~1 min of inductor compilation on a cold cache."""
    _train_and_resume(component, tmp_path, compiled=True)


# ---------------------------------------------------------------- FSDP2 (2 gloo ranks on CPU)


def _fsdp_worker(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed as dist

    from minippo.parallel import shard_model

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for comp in COMPONENTS:
            with _eager():

                def make(comp=comp):
                    m = shard_model(_model())
                    return m, build_optimizer(_node(comp), m.parameters())

                model, opt = make()
                losses = [_step(model, opt) for _ in range(3)]
                w1 = model.layers[0].feed_forward.w1.weight
                local = type(opt.state[w1]["exp_avg"].to_local()).__name__
                ckpt = Checkpointer(os.path.join(out_dir, comp))
                ckpt.save(3, models={"actor": (model, opt)}, states={})
                uninterrupted = [_step(model, opt) for _ in range(3)]
                model2, opt2 = make()
                ckpt.load(ckpt.resolve("latest"), models={"actor": (model2, opt2)}, states={})
                w1 = model2.layers[0].feed_forward.w1.weight
                local2 = type(opt2.state[w1]["exp_avg"].to_local()).__name__
                resumed = [_step(model2, opt2) for _ in range(3)]
            results[comp] = (losses, local, local2, uninterrupted, resumed)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_dtensor_params_train_and_resume(tmp_path):
    """FSDP2 on CPU: every optimizer steps DTensor parameters (torchao's quantized states wrapped
    in DTensor), and the sharded states survive a DCP save/load on 2 ranks."""
    run_on_ranks(_fsdp_worker, str(tmp_path), world_size=2)
    results = torch.load(tmp_path / "results.pt")
    for comp, (losses, local, local2, uninterrupted, resumed) in results.items():
        assert losses[-1] < losses[0], comp
        bits = optimizer_spec(_node(comp))[0].bits
        expected = f"OptimState{bits}bit" if bits else "Tensor"
        assert local == local2 == expected, comp
        assert resumed == uninterrupted, comp


# ---------------------------------------------------------------- the recipe with each optimizer

REPO = Path(__file__).resolve().parents[2]
RECIPE, TINY = REPO / "recipes" / "async_ppo.py", REPO / "configs" / "tiny_cpu.yaml"


def _recipe_run(tmp_path, component: str, *extra: str) -> list[dict]:
    recipe = runpy.run_path(str(RECIPE), run_name="recipe")["AsyncPPORecipe"]
    node = f"{{_component_: {component}, lr: 3.0e-3, weight_decay: 0.0}}"
    cfg = load_config(
        TINY,
        [
            f"output_dir={tmp_path}",
            "progress_bar=false",
            "checkpoint.export_hf=false",
            "checkpoint.every_n_steps=2",
            f"optimizer={node}",
            f"critic.optimizer={node}",
            *extra,
        ],
    )
    run = recipe(cfg)
    try:
        run.setup(cfg)
        run.train()
        kinds = {type(s["exp_avg"]).__name__ for s in run.optimizer.state.values()}
    finally:
        run.cleanup()
    rows = read_jsonl(cfg.metric_logger.path)
    return rows, kinds


@pytest.mark.slow
@pytest.mark.skipif(not (RECIPE.exists() and TINY.exists()), reason="needs the async_ppo recipe")
@pytest.mark.parametrize("component", COMPONENTS)
def test_recipe_trains_and_resumes_with_each_optimizer(component, tmp_path):
    """The tiny_cpu recipe, 4 steps (compiled torchao step), then a resume from the step-2
    checkpoint that finishes the run with the low-bit states restored."""
    rows, kinds = _recipe_run(tmp_path, component, "total_steps=4")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    bits = optimizer_spec(_node(component))[0].bits
    assert (f"OptimState{bits}bit" if bits else "Tensor") in kinds
    (tmp_path / "metrics.jsonl").unlink()
    ckpt = tmp_path / "checkpoints" / "step_000002"
    rows, kinds = _recipe_run(tmp_path, component, "total_steps=4", f"resume_from={ckpt}")
    assert [r["step"] for r in rows] == [2, 3]
    assert (f"OptimState{bits}bit" if bits else "Tensor") in kinds
