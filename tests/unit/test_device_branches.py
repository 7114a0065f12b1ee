"""The device-specific branches of the trainer, the engine and the process-group code, run on a
CPU: each decision a CUDA machine takes (which device a rank uses, where a collective's tensor
lives, which RNG states a checkpoint carries, which linear kernel the engine uses) is a function
called here with the inputs a GPU node gives it. tests/README.md ("Device-specific branches")
lists every branch with its test, and the ones only a GPU can run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minippo.engine._cpu_kernels import onednn_linear_available
from minippo.parallel import distributed
from minippo.parallel.distributed import collective_device, placement
from minippo.training import checkpoint, nan_guard
from minippo.training.checkpoint import capture_rng_state, restore_rng_state
from minippo.training.interrupt import StopOnSignal


def test_placement_of_each_rank_on_a_gpu_node_and_on_a_cpu():
    # 4 GPUs: local rank r trains on cuda:r over NCCL
    assert placement(3, cuda=True, device_count=4) == (torch.device("cuda", 3), "nccl")
    assert placement(0, cuda=True, device_count=4, backend="gloo") == (
        torch.device("cuda", 0),
        "gloo",
    )
    with pytest.raises(RuntimeError, match="LOCAL_RANK 4 but only 4 CUDA devices"):
        placement(4, cuda=True, device_count=4)
    assert placement(3, cuda=False, device_count=0) == (torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        placement(0, cuda=False, device_count=0, backend="nccl")


@pytest.fixture
def nccl_group(monkeypatch):
    """A 2-rank NCCL group as the collectives see it (backend, size, current device 1), with an
    all_reduce that records the tensors it gets."""
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: reduced.append(t))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    return reduced


def test_collectives_use_the_current_gpu_under_nccl(nccl_group, monkeypatch):
    assert collective_device() == torch.device("cuda", 1)
    assert collective_device(default="cpu") == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert collective_device() == torch.device("cpu")


@pytest.mark.parametrize("site", ["checkpoint", "nan_guard", "interrupt"])
def test_each_collective_puts_its_tensor_where_collective_device_says(
    nccl_group, monkeypatch, site
):
    """The flags of a checkpoint save, of the non-finite guard and of a signal go through an
    all-reduce; under NCCL their tensor must be on the GPU. CPU torch has no CUDA tensors, so
    collective_device stands in with a device of its own choosing (its math is tested above) and
    the all-reduce checks that it got a tensor there."""
    chosen = torch.device("cpu")
    asked: list[torch.device | str] = []

    def where(default="cpu"):
        asked.append(default)
        return chosen

    for module in (checkpoint, nan_guard, distributed):
        monkeypatch.setattr(module, "collective_device", where, raising=False)
    if site == "checkpoint":
        assert checkpoint._all_ranks_ok(True)
    elif site == "nan_guard":
        assert nan_guard.all_finite(torch.tensor(1.0), 2.0)
    else:
        assert not StopOnSignal().requested()
    assert asked and len(nccl_group) == 1 and nccl_group[0].device == chosen


def test_a_checkpoint_carries_and_restores_the_cuda_rng_states(monkeypatch):
    """On a GPU the RNG state of every CUDA device is saved and restored with the CPU's."""
    saved = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    state = capture_rng_state()
    assert state["cuda"] is saved
    restore_rng_state(state)
    assert restored == [saved]


def test_the_engine_uses_the_plain_linear_kernel_off_the_cpu():
    """oneDNN's packed kernel is a CPU kernel: on a GPU (or any other device) the engine runs the
    model's own linear layers, the reference the packed kernel is checked against
    (test_engine_torch.py::test_packed_linears_keep_names_and_outputs_and_follow_publishes)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert not onednn_linear_available(torch.device("cuda", 0), dtype)


def test_a_torch_engine_on_cuda_takes_its_ranks_gpu(monkeypatch):
    """engine.device: cuda puts rank r's TorchEngine on cuda:r (the trainer's GPU), not on the
    engine process's current device (GPU 0 on every rank)."""
    from minippo.engine.torch_engine import engine_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine_device("cuda") == torch.device("cuda", 3)
    assert engine_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert engine_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert engine_device("cuda") == torch.device("cuda", 0)


@pytest.fixture
def pinning(monkeypatch):
    """CUDA present, as the host-copy code sees it, with a CPU stand-in for pinned memory (CPU
    torch cannot pin: ``pin_memory=True`` needs a CUDA driver): every ``torch.empty`` /
    ``empty_like`` records its ``pin_memory`` and allocates pageable memory; the CUDA
    synchronisations and cache releases are recorded. Returns (pins, cuda calls)."""
    pins: list[bool] = []
    calls: list[str] = []
    empty, empty_like = torch.empty, torch.empty_like

    def recorded(alloc):
        def stand_in(*args, pin_memory=False, **kwargs):
            pins.append(pin_memory)
            return alloc(*args, **kwargs)

        return stand_in

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", recorded(empty))
    monkeypatch.setattr(torch, "empty_like", recorded(empty_like))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return pins, calls


def test_weight_snapshots_are_pinned_on_the_host_of_a_gpu_machine(pinning):
    """alloc_like (the old-actor / published-weights snapshots): host buffers are pinned when CUDA
    is present, so that the copies from the GPU are asynchronous; buffers on another device are
    not (only host memory is pinned); shapes and dtypes as asked either way."""
    from minippo.parallel.weight_swap import alloc_like

    pins, _ = pinning
    like = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)]
    out = alloc_like(like, dtype=None, device=None)  # each on its own device: the host
    assert pins == [True, True]
    assert [(t.shape, t.dtype) for t in out] == [(t.shape, t.dtype) for t in like]
    out = alloc_like(like, dtype=torch.float16, device=torch.device("meta"))
    assert pins[2:] == [False, False] and all(t.dtype == torch.float16 for t in out)


def test_trainer_offload_pins_its_host_copies_on_a_gpu_machine(pinning):
    """TrainerOffload.offload: every host copy (parameters, gradients, optimizer states) is
    pinned when CUDA is present, then the copies are waited for and the freed device blocks
    released; reload copies back unpinned (to the device) and waits. The values come back bit
    for bit through the pinned-path code (the pinning itself needs a GPU)."""
    from minippo.parallel.offload import TrainerOffload

    pins, calls = pinning
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    # weight and bias: the parameter, its gradient and Adam's step, exp_avg and exp_avg_sq
    moves = 2 * (2 + 3)
    offload = TrainerOffload([(model, opt)])
    pins.clear()  # the model's own allocations
    offload.offload()
    assert pins == [True] * moves
    # the device blocks are released once, after the asynchronous copies were waited for
    assert calls[-1] == "empty_cache" and set(calls[:-1]) == {"synchronize"}
    pins.clear()
    calls.clear()
    offload.reload()
    assert pins == [False] * moves and calls and set(calls) == {"synchronize"}
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]) and p.grad is not None


def test_the_trainer_allocator_cap_beside_an_engine_on_its_gpu(monkeypatch):
    """cap_trainer_memory: with SGLang on the trainer's GPU in overlap mode, the CUDA allocator
    of that device is capped at the planned trainer's share of the GPU's memory (read from the
    device); on a CPU, or in alternate mode, nothing is capped."""
    from minippo.config import load_config
    from minippo.plan import GiB, cap_trainer_memory, trainer_memory_fraction

    gpu = 80 * GiB
    capped = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": gpu})()
    )
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d))
    )
    model = ["checkpoint_path=null", "model={_component_: minippo.models.qwen3_0_6b}"]
    share = ["rollout.share_gpu_with_engine=true"]
    cfg = load_config("qwen3_0_6b_gsm8k_1gpu", [*model, *share, "rollout.mode=overlap"])
    cap_trainer_memory(cfg, "cuda:1")
    assert capped == [(trainer_memory_fraction(cfg, gpu_mem_bytes=gpu), torch.device("cuda", 1))]
    assert 0 < capped[0][0] <= 1 - cfg.engine.mem_fraction_static
    cap_trainer_memory(cfg, "cpu")
    alternate = load_config("qwen3_0_6b_gsm8k_1gpu", [*model, *share, "rollout.mode=alternate"])
    cap_trainer_memory(alternate, "cuda:1")
    assert len(capped) == 1
