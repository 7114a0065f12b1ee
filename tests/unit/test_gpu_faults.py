"""What a GPU run meets, checked on CPU: the process group's timeout (``parallel.timeout_s``)
reaches ``init_process_group``, NVLS is off for the trainer's NCCL communicator unless the user set
it, ``deterministic: true`` turns on torch's deterministic algorithms, fp32 on CUDA and a GPU
below sm80 are refused with one line each, and the allocator report is None without CUDA."""

from datetime import timedelta

import pytest
import torch
from omegaconf import OmegaConf

from minippo.config import load_config
from minippo.parallel import distributed
from minippo.parallel.distributed import (
    DEFAULT_TIMEOUT_S,
    apply_deterministic,
    check_gpu_capability,
    init_distributed,
    process_group_timeout_s,
)
from minippo.plan import ReservedLive, reserved_vs_live
from minippo.plan.formula import ALLOCATOR_SLACK_BYTES, GiB
from minippo.training.preflight import (
    ASYNC_PPO_SCHEMA,
    FP32_CUDA_ATTENTION_LIMIT,
    async_ppo_shape_problems,
    config_problems,
    dtype_device_problem,
    fp32_attention_bytes,
)


@pytest.fixture
def fake_group(monkeypatch):
    """torchrun's variables for one rank and a spy in place of ``dist.init_process_group``."""
    calls = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(distributed, "die_with_parent", lambda: None)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(kw))
    return calls


def test_the_default_timeout_reaches_init_process_group(fake_group):
    info = init_distributed()
    assert info.distributed and info.world_size == 1
    (kw,) = fake_group
    assert kw["timeout"] == timedelta(seconds=DEFAULT_TIMEOUT_S)
    assert 30 * 60 <= DEFAULT_TIMEOUT_S <= 60 * 60
    assert kw["backend"] == "gloo"


def test_parallel_timeout_s_reaches_init_process_group(fake_group):
    cfg = OmegaConf.create({"dtype": "fp32", "parallel": {"timeout_s": 7200}})
    init_distributed(cfg=cfg)
    assert fake_group[0]["timeout"] == timedelta(hours=2)


def test_a_config_without_the_key_gets_the_default():
    assert process_group_timeout_s(OmegaConf.create({})) == DEFAULT_TIMEOUT_S
    assert process_group_timeout_s(OmegaConf.create({"parallel": {"sharding": "fsdp"}})) == (
        DEFAULT_TIMEOUT_S
    )
    with pytest.raises(ValueError, match=r"parallel\.timeout_s must be a number of seconds > 0"):
        process_group_timeout_s(OmegaConf.create({"parallel": {"timeout_s": 0}}))


def test_nvls_is_off_for_the_trainer_under_nccl_unless_set(fake_group, monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setattr(
        distributed,
        "placement",
        lambda *a, **k: (torch.device("cpu"), "nccl"),
    )
    init_distributed()
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    init_distributed()
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert fake_group[0]["device_id"] == torch.device("cpu")


def test_gloo_leaves_nvls_alone(fake_group, monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    init_distributed()
    import os

    assert "NCCL_NVLS_ENABLE" not in os.environ


def test_schema_accepts_and_refuses_the_new_keys():
    base = load_config("tiny_cpu")
    assert OmegaConf.select(base, "parallel.timeout_s") is None
    ok = OmegaConf.merge(base, {"parallel": {"timeout_s": 3600}, "deterministic": True})
    assert config_problems(ok, ASYNC_PPO_SCHEMA) == []
    bad = OmegaConf.merge(base, {"parallel": {"timeout_s": -1}, "deterministic": "yes"})
    problems = config_problems(bad, ASYNC_PPO_SCHEMA)
    assert any(p.startswith("parallel.timeout_s must be") for p in problems), problems
    assert any(p.startswith("deterministic must be") for p in problems), problems


def test_apply_deterministic(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    apply_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    import os

    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        apply_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_init_distributed_applies_deterministic_from_the_config(monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    try:
        init_distributed(cfg=OmegaConf.create({"dtype": "fp32", "deterministic": True}))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    init_distributed(cfg=OmegaConf.create({"dtype": "fp32"}))
    assert not torch.are_deterministic_algorithms_enabled()


def test_fp32_on_cuda_is_refused_in_one_line_beyond_1_gib_of_attention_matrices():
    line = dtype_device_problem("cuda", "fp32", 31 * GiB + GiB // 2)
    assert line is not None and "\n" not in line
    assert line.startswith("dtype=fp32 on a CUDA device:")
    assert "(31.5 GiB per training forward" in line and "set dtype=bf16" in line
    assert "of unknown size" in dtype_device_problem("cuda", "float32", None)
    assert dtype_device_problem("cuda", "fp32", FP32_CUDA_ATTENTION_LIMIT) is None
    assert dtype_device_problem("cpu", "fp32", None) is None
    assert dtype_device_problem("cuda", "bf16", None) is None
    assert dtype_device_problem("cuda", "fp16", 10 * GiB) is None


def test_fp32_attention_bytes_from_the_config():
    """n_layers · H · T · S · 4: Qwen3-0.6B (28 layers, 16 heads) at 12288 tokens per forward of
    sequences up to 1536 tokens."""
    over = ["checkpoint_path=null", "model={_component_: minippo.models.qwen3_0_6b}"]
    assert fp32_attention_bytes(load_config("qwen3_0_6b_gsm8k_1gpu", over)) == (
        28 * 16 * 12288 * 1536 * 4
    )
    no_shape = load_config("qwen3_0_6b_gsm8k_1gpu", ["checkpoint_path=null", "model=null"])
    assert fp32_attention_bytes(no_shape) is None


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_math_cpu", "tiny_sglang_cpu"])
def test_the_cpu_configs_pass_with_or_without_cuda(name, monkeypatch):
    cfg = load_config(name)
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert not [p for p in async_ppo_shape_problems(cfg, 1, False) if "CUDA" in p]


def test_a_gpu_config_in_fp32_on_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    over = ["checkpoint_path=null", "model={_component_: minippo.models.qwen3_0_6b}", "dtype=fp32"]
    problems = async_ppo_shape_problems(load_config("qwen3_0_6b_gsm8k_1gpu", over), 1, True)
    assert [p for p in problems if p.startswith("dtype=fp32 on a CUDA device")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problems = async_ppo_shape_problems(load_config("qwen3_0_6b_gsm8k_1gpu", over), 1, True)
    assert not [p for p in problems if "CUDA" in p]


def test_a_gpu_below_sm80_gets_one_line():
    line = check_gpu_capability((7, 5), "Tesla T4", "bf16")
    assert line is not None and "\n" not in line
    assert line.startswith("dtype=bf16 on Tesla T4 (compute capability sm75)")
    assert "sm80" in line
    assert check_gpu_capability((8, 0), "NVIDIA A100", "bf16") is None
    assert check_gpu_capability((9, 0), "NVIDIA H100", "bf16") is None
    assert check_gpu_capability((7, 0), "Tesla V100", "fp32") is None


def test_reserved_vs_live_is_none_without_cuda_and_judges_the_margin():
    if not torch.cuda.is_available():
        assert reserved_vs_live() is None
    assert reserved_vs_live("cpu") is None
    r = ReservedLive(reserved=3 * GiB, allocated=3 * GiB - ALLOCATOR_SLACK_BYTES)
    assert r.slack == ALLOCATOR_SLACK_BYTES and r.within_margin
    over = ReservedLive(reserved=3 * GiB, allocated=2 * GiB)
    assert not over.within_margin and "OVER" in over.line()
    assert "reserved 3.00 GiB, live 2.00 GiB, slack 1.00 GiB" in over.line()
