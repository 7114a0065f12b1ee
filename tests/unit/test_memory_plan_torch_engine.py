"""The memory plan of a TorchEngine on the trainer's GPU (``engine.device: cuda``): its weights, the
KV cache of one wave and the larger of the prefill's and one decode step's working set, in the
generation phase of ``rollout.mode: alternate`` (moved to the host while the trainer trains) and
at once with the trainer in ``overlap``. Expected figures are written from the shapes of
configs/qwen3_0_6b_synthetic_1gpu.yaml (formulas only: no fake-tensor step)."""

import torch

from minippo.config import load_config
from minippo.models import Transformer, qwen3_0_6b
from minippo.plan import GiB, TorchEngineShape, plan_from_config, torch_engine_bytes
from minippo.plan.formula import ENGINE_AFTER_RELEASE_BYTES

CONFIG = "qwen3_0_6b_synthetic_1gpu"


def _plan(*over):
    return plan_from_config(load_config(CONFIG, list(over)), gpu_mem_gib=141)


def _engine(plan):
    return next(i for i in plan.items if i.name == "engine (TorchEngine)")


def test_torch_engine_bytes_of_the_synthetic_config():
    args = qwen3_0_6b()  # 28 layers, 8 kv heads of 128, vocabulary 151,936, tied embeddings
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(args).parameters())  # the tied lm_head once
    # 16 groups x 8 samples in flight = 128 rows (<= engine.max_batch_size 256) of the prompt
    # "<bos>dddd=" (6 tokens) + 256 new tokens, bf16 (2 bytes)
    shape = TorchEngineShape(rows=128, prompt_len=6, max_new_tokens=256, dtype_bytes=2)
    parts = torch_engine_bytes(args, shape)
    assert parts["weights"] == params * 2
    assert parts["kv_cache"] == 128 * 28 * 2 * 8 * 128 * (6 + 256) * 2  # k and v, every layer
    # a short prompt: the decode step's logits (bf16) + their fp32 copy + fp32 exponentials
    assert parts["working"] == 128 * 151_936 * (2 + 4 + 4)
    plan = _plan()
    assert plan.inputs.torch_engine == shape and plan.inputs.device == "cuda"
    assert _engine(plan).device == sum(parts.values())


def test_alternate_counts_the_engine_in_generation_only_and_overlap_at_once():
    alt = _plan()  # as shipped: alternate, offload_trainer
    engine = _engine(alt).device
    context = next(i for i in alt.items if i.name == "CUDA context + slack").device
    assert alt.alternates and not _engine(alt).at_peak
    # generation: the engine + what stays on the device with the trainer's state offloaded
    # (KeepOldActor keeps its snapshots on the host): the CUDA context alone
    assert alt.generation_total() == engine + context
    # while the trainer trains the engine's process keeps only its CUDA context (an estimate)
    assert alt.training_total == alt.formula_trainer_total + ENGINE_AFTER_RELEASE_BYTES
    assert "engine (TorchEngine)" in alt.table() and "  generation " in alt.table()
    overlap = _plan("rollout.mode=overlap", "rollout.offload_trainer=false")
    assert overlap.training_total == overlap.formula_trainer_total + _engine(overlap).device
    # overlap keeps groups_per_batch groups in flight, as alternate with oversample 1.0
    assert _engine(overlap).device == engine


def test_rows_follow_oversample_and_max_batch_size_and_cpu_engines_are_not_planned():
    more = _plan("rollout.oversample=1.5")  # ceil(16 x 1.5) = 24 groups x 8 samples
    assert more.inputs.torch_engine.rows == 192
    capped = _plan("rollout.oversample=1.5", "engine.max_batch_size=100")
    assert capped.inputs.torch_engine.rows == 100  # one wave decodes at most max_batch_size
    shared = _plan("engine.in_process=true")
    assert not shared.inputs.torch_engine.own_process
    assert "CUDA context not counted" not in _engine(shared).note
    assert shared.training_total == shared.formula_trainer_total  # one process, one context
    on_cpu = plan_from_config(load_config(CONFIG, ["engine.device=cpu"]))
    assert on_cpu.inputs.device == "cpu" and on_cpu.inputs.torch_engine is None
    assert not any(i.name.startswith("engine") for i in on_cpu.items)
    assert _plan().generation_total() < 8 * GiB  # 1.1 GiB weights + 3.6 GiB KV cache + context
