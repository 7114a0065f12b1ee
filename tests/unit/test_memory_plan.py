"""The memory planner: exact per-block activation bytes, agreement with the measured peak of the
tiny job on CPU (within 15%), config reading from the components with clear errors, the measured
plan (one recipe step on fake tensors), and the ``plan`` command.

What is compared: the plan's "trainer total" (parameters, gradients, optimizer states of actor and
critic, the larger activation set, correction state; on CPU host items are RAM too) against the
peak of live tensor bytes that :class:`TensorMemoryTracker` records while the tiny job builds the
actor, critic, optimizers and correction state and runs two training steps (two micro-batches of
gradient accumulation each, actor then critic, correction prepare / EWMA update / snapshots).

``WeightCopies`` / ``FakeSnapshots`` below stand for a correction class defined outside the
package that implements the interface the plan reads (``stored_weights``, ``scoring_passes``).
"""

import argparse
import dataclasses
import math
import runpy
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from benchmarks._common import TensorMemoryTracker
from minippo.config import ConfigError, load_config
from minippo.models import (
    Transformer,
    ValueModel,
    init_weights,
    llama3_2_1b,
    pack,
    qwen3_4b,
    qwen3_tiny,
    token_logprobs,
)
from minippo.parallel.activation_checkpointing import apply_activation_checkpointing
from minippo.plan import (
    GiB,
    PlanInputs,
    block_saved_bytes_per_token,
    correction_cost,
    measure_from_config,
    model_param_shapes,
    plan_from_config,
    plan_inputs_from_config,
    plan_memory,
)
from minippo.plan.formula import fused_loss_bytes, pinned_rounding
from minippo.rl.correction import build_correction
from minippo.rl.types import RolloutBatch
from minippo.training.optimizers import build_optimizer, local_numel, optimizer_spec
from tests.helpers import saved_bytes

CORRECTIONS = {"ewma": "EWMA", "keep_old_actor": "KeepOldActor", "tis": "TIS"}


@dataclasses.dataclass(frozen=True)
class WeightCopies:
    """The fields of ``minippo.rl.correction.WeightCopies``."""

    what: str
    copies: int
    dtype: str | None
    storage: str


class FakeSnapshots:
    """A correction class from outside the package: ``versions`` snapshots (max_staleness + 1)
    in ``storage`` at ``storage_dtype``, one master-dtype scratch copy on the accelerator, and
    ``passes`` no-grad actor forwards per step."""

    def __init__(self, *, storage: str = "accelerator", storage_dtype=None, passes: int = 1):
        pass

    @classmethod
    def stored_weights(
        cls, *, max_staleness, partial_rollout, storage="accelerator", storage_dtype=None, passes=1
    ):
        if storage not in ("cpu", "accelerator"):
            raise ValueError(f"storage={storage!r}")
        versions = max_staleness + 1 + int(partial_rollout)
        return [
            WeightCopies("snapshots", versions, storage_dtype, storage),
            WeightCopies("scratch", 1, None, "accelerator"),
        ]

    @classmethod
    def scoring_passes(cls, *, max_staleness, passes=1, **options):
        return passes


FAKE = f"{__name__}.FakeSnapshots"


def _saved_bytes(model, tokens, mask, positions) -> int:
    n, _ = saved_bytes(
        model,
        lambda: model(tokens, attention_mask=mask, position_ids=positions, return_hidden=True),
    )
    return n


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["qwen3", "llama_mha"])
def test_block_activation_formula_is_exact(dtype, variant, packed):
    args = qwen3_tiny()
    if variant == "llama_mha":  # no q/k norm, as many kv heads as heads, another width
        args = dataclasses.replace(args, qk_norm=False, n_kv_heads=4, intermediate_size=96)
    B, S = 2, 24
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :3] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    c = 2 if dtype == torch.bfloat16 else 4
    saved = {}
    for n_layers in (1, 3):
        a = dataclasses.replace(args, n_layers=n_layers)
        model = init_weights(Transformer(a)).to(dtype)
        if packed:  # two sequences of 21 and 24 tokens: one attention bucket, 3 slots of padding
            layout = pack(mask)
            saved[n_layers], _ = saved_bytes(
                model, partial(model, tokens, packed=layout, return_hidden=True)
            )
        else:
            saved[n_layers] = _saved_bytes(model, tokens, mask, positions)
    per_block = (saved[3] - saved[1]) // 2
    if packed:
        # the bucket's right padding (not in the formula): q, k, v and the output at its 3 slots
        H, Hkv, hd = args.n_heads, args.n_kv_heads, args.head_dim
        padding = 3 * c * hd * (2 * H + 2 * Hkv) + 3 * 4 * H
        formula = block_saved_bytes_per_token(
            args, compute_bytes=c, mask=False, device="cpu", packed=True
        )
        assert per_block == formula * (B * S - 3) + padding
    else:
        formula = block_saved_bytes_per_token(args, compute_bytes=c, mask=True, device="cpu")
        assert per_block == formula * B * S


def test_tracker_counts_live_storages_and_peak():
    tracker = TensorMemoryTracker()
    keep = torch.zeros(10)
    tracker.track(keep)
    with tracker:
        a = torch.ones(100)  # 400 bytes
        b = a * 2  # +400
        del a, b
        c = torch.ones(25)
    assert tracker.peak["cpu"] == 40 + 800
    assert tracker.current["cpu"] == 40 + 100
    del c


def _batch(args, B, P, R, gen) -> RolloutBatch:
    ids = torch.randint(0, args.vocab_size, (B, P + R), generator=gen)
    am = torch.ones(B, P + R, dtype=torch.bool)
    am[0, :3] = False
    am[1, P + R - 5 :] = False
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=am,
        position_ids=pos,
        response_mask=am[:, P:].float(),
        rollout_logprobs=torch.full((B, R), -1.0),
        versions=torch.zeros(B, R, dtype=torch.long),
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )


def tiny_job_peak(
    args,
    *,
    optimizer="minippo.training.optimizers.AdamW",
    correction="ewma",
    checkpointing=False,
    micro_batch=4,
    P=16,
    R=48,
    chunk=64,
    critic=True,
    max_staleness=2,
):
    """(measured peak bytes, plan) of the tiny job: see the module docstring."""
    gen = torch.Generator().manual_seed(0)
    node = OmegaConf.create({"_component_": optimizer, "lr": 1e-3})
    cfg = OmegaConf.create(
        {
            "rollout": {"max_staleness": max_staleness},
            "correction": {"_component_": f"minippo.rl.correction.{CORRECTIONS[correction]}"},
        }
    )
    tracker = TensorMemoryTracker()
    with tracker, torch.compiler.set_stance("force_eager"):
        actor = init_weights(Transformer(args))
        models = [actor]
        if critic:
            models.append(init_weights(ValueModel(args)))
        if checkpointing:
            for m in models:
                apply_activation_checkpointing(m)
        opts = [build_optimizer(node, m.parameters()) for m in models]
        corr = build_correction(cfg, temperature=1.0, updates_per_step=1)
        corr.on_weights_published(0, actor)
        # max_staleness + 1 steps: a step trains while holding every snapshot the plan counts
        # for keep_old_actor (one per version 0..max_staleness)
        for step in range(max_staleness + 1):
            batch = _batch(args, 2 * micro_batch, P, R, gen)
            corr.prepare(batch, actor, step=step)
            for model, opt in zip(models, opts):
                for i in range(2):  # gradient accumulation over two micro-batches
                    mb = batch.select(slice(i * micro_batch, (i + 1) * micro_batch))
                    kw = {"attention_mask": mb.attention_mask, "position_ids": mb.position_ids}
                    if model is actor:
                        out = token_logprobs(model, mb.input_ids, start=P, chunk_size=chunk, **kw)
                    else:
                        out = model(mb.input_ids, **kw)[:, P - 1 : -1]
                    loss = (out * mb.response_mask).sum() / mb.response_mask.sum()
                    loss.backward()
                    del out, loss
                opt.step()
                opt.zero_grad(set_to_none=True)
            corr.after_optimizer_step(actor)
            corr.on_weights_published(step + 1, actor)
    spec = optimizer_spec(node)
    x = PlanInputs(
        actor=args,
        critic=args if critic else None,
        reference=False,
        world_size=1,
        device="cpu",
        master_bytes=4,
        compute_bytes=4,
        micro_batch=micro_batch,
        seq_len=P + R,
        response_len=R,
        activation_checkpointing=checkpointing,
        logits_chunk=chunk,
        actor_optimizer=spec,
        critic_optimizer=spec,
        correction=correction_cost(
            cfg.correction, max_staleness=max_staleness, partial_rollout=False
        ),
        score_rows=2 * micro_batch,  # prepare() scores the whole step batch in one forward
    )
    return tracker.peak["cpu"], plan_memory(x)


def _wider():
    return dataclasses.replace(
        qwen3_tiny(vocab_size=512), dim=128, intermediate_size=384, n_layers=3
    )


REPO = Path(__file__).resolve().parents[2]
RECIPE, TINY = REPO / "recipes" / "async_ppo.py", REPO / "configs" / "tiny_cpu.yaml"


@pytest.mark.skipif(not (RECIPE.exists() and TINY.exists()), reason="needs the async_ppo recipe")
def test_plan_agrees_with_the_measured_peak_of_the_tiny_cpu_recipe_run(tmp_path):
    """The real recipe (configs/tiny_cpu.yaml, 3 steps, TorchEngine in its own process): the
    trainer process's peak of live tensor bytes, from setup to the last step, against the formula
    (within 15%) and against the measured plan, one step on fake tensors.

    The fake step runs the recipe's own functions on the same shapes, so it may miss only what the
    recipe allocates outside steps 2 and 4: the weight publish, one bucket of the actor's full
    weights at a time (at most the actor's fp32 bytes, alive after the updates); and it pads every
    row to the longest prompt and max_new_tokens, as the toy task's batches are (one prompt
    length; some row of each 128-row batch reaches 4 tokens). Hence |fake - real| <= the actor's
    fp32 bytes."""
    recipe = runpy.run_path(str(RECIPE), run_name="recipe")["AsyncPPORecipe"]
    cfg = load_config(
        TINY,
        [
            "total_steps=3",
            f"output_dir={tmp_path}",
            "progress_bar=false",
            "checkpoint.export_hf=false",
            "checkpoint.every_n_steps=100",
        ],
    )
    run = recipe(cfg)
    tracker = TensorMemoryTracker()
    try:
        with tracker:
            run.setup(cfg)
            run.train()
    finally:
        run.cleanup()
    plan = plan_from_config(cfg)
    measured = tracker.peak["cpu"]
    err = plan.trainer_total / measured - 1
    assert abs(err) < 0.15, (plan.trainer_total, measured, err)
    fake = measure_from_config(cfg).peak
    actor_bytes = 4 * sum(math.prod(s) for s in model_param_shapes(qwen3_tiny()))
    assert abs(fake - measured) <= actor_bytes, (fake, measured, actor_bytes)


def test_plan_agrees_with_measured_peak_of_the_tiny_job():
    measured, plan = tiny_job_peak(qwen3_tiny())
    err = plan.trainer_total / measured - 1
    assert abs(err) < 0.15, (plan.trainer_total, measured, err)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"checkpointing": True},
        {"optimizer": "torchao.optim.AdamW8bit"},
        {"optimizer": "torchao.optim.AdamW4bit"},
        {"correction": "keep_old_actor"},
        {"correction": "tis", "critic": False},
        {"micro_batch": 8, "R": 96},
    ],
    ids=str,
)
@pytest.mark.parametrize("args", [qwen3_tiny(), _wider()], ids=["tiny", "wider"])
def test_plan_agrees_with_measured_peak_across_switches(kw, args):
    measured, plan = tiny_job_peak(args, **kw)
    err = plan.trainer_total / measured - 1
    assert abs(err) < 0.15, (plan.trainer_total, measured, err)


def _run_cfg(**over):
    """A run config with the recipe's keys (as in configs/*.yaml)."""
    cfg = {
        "model": {"_component_": "minippo.models.qwen3_4b"},
        "checkpoint_path": None,
        "advantage_estimator": "gae",
        "dtype": "bf16",
        "dataset": {"_component_": "minippo.data.load_prompt_dataset", "max_prompt_tokens": 2048},
        "rollout": {"max_new_tokens": 8192, "max_staleness": 2, "partial_rollout": True},
        "ppo": {"micro_batch_size": 1, "score_micro_batch_size": 1},
        "kl": {"coef": 0.0},
        "critic": {"checkpoint_path": None, "optimizer": {"_component_": "torch.optim.AdamW"}},
        "optimizer": {"_component_": "minippo.training.optimizers.AdamW", "lr": 1e-6},
        "correction": {"_component_": "minippo.rl.correction.KeepOldActor"},
        "activation_checkpointing": True,
        "engine": {
            "_component_": "minippo.engine.sglang_engine.SGLangEngine",
            "mem_fraction_static": 0.35,
        },
    }
    cfg.update(over)
    return OmegaConf.create(cfg)


def _plan(cfg, gpu=141):
    return plan_from_config(cfg, gpu_mem_gib=gpu, world_size=8)


def test_plan_from_config_for_a_4b_model_on_8_gpus():
    plan = _plan(_run_cfg())
    items = {i.name: i for i in plan.items}
    params = items["actor parameters"].device
    # Qwen3-4B (tied lm_head) in fp32 over 8 ranks: ~4.0B x 4 / 8 bytes; AdamW states twice that
    n = sum(math.prod(s) for s in model_param_shapes(qwen3_4b()))
    assert 3.9e9 < n < 4.1e9
    assert params == pytest.approx(n * 4 / 8, rel=1e-3)
    assert items["actor gradients"].device == params
    assert abs(items["actor optimizer states"].device - 2 * params) < 1e6
    # tied lm_head: the critic has the same embeddings and blocks plus a D -> 1 head
    assert items["critic parameters"].device == pytest.approx(params, rel=1e-4)
    snap = items["correction (KeepOldActor)"]
    # 4 live versions; no swap buffer: the actor is restored from the latest (exact) snapshot
    # pinned host snapshots: every tensor's block rounded up to a power of two
    assert plan.pinned_factor == pytest.approx(pinned_rounding(_local_numels(qwen3_4b(), 8)))
    assert snap.device == 0
    assert snap.host == pytest.approx(4 * params * plan.pinned_factor, rel=0.01)
    assert items["engine (mem_fraction)"].device == int(0.35 * 141 * GiB)
    assert plan.fits is (plan.device_total <= 141 * GiB)
    text = plan.table()
    assert "actor optimizer states" in text and "biggest:" in text


def test_packed_passes_plan_the_budget_tokens_and_no_mask():
    """The shipped 4B config packs with a budget of 20480 tokens per training forward (4 x 5120,
    its longest sequence): the activations are those of 20480 real tokens; the same forwards
    padded (4 rows of 5120) add the additive mask c·T·S and, on a GPU, the key/value heads
    repeated for the masked kernels (c·hd·2·(H − H_kv) per token, in the block recomputed under
    activation checkpointing, which runs after the fused loss's pass: the larger of the two
    counts), nothing else."""
    over = ["checkpoint_path=null", "model={_component_: minippo.models.qwen3_4b}"]
    cfg = load_config("qwen3_4b_dapo_math_8gpu", over)
    x = plan_inputs_from_config(cfg, world_size=8)
    assert x.packed and not x.mask and x.micro_tokens == x.train_tokens == 20480
    assert x.seq_len == 5120 and x.micro_batch == 4 and x.score_rows == 16
    padded_cfg = load_config(
        "qwen3_4b_dapo_math_8gpu",
        [
            *over,
            "ppo.pack=false",
            "ppo.micro_batch_size=4",
            "ppo.max_tokens_per_micro_batch=null",
            "ppo.score_micro_batch_size=16",
            "ppo.score_max_tokens_per_micro_batch=null",
        ],
    )
    padded = plan_inputs_from_config(padded_cfg, world_size=8)
    assert padded.mask and padded.train_tokens == 20480
    a = _item(plan_memory(x), "actor activations").device
    b = _item(plan_memory(padded), "actor activations").device
    args, c, T, S = x.actor, x.compute_bytes, 20480, 5120
    repeat = c * args.head_dim * 2 * (args.n_heads - args.n_kv_heads)
    assert x.activation_checkpointing
    R = T * x.response_len // x.seq_len
    fused = fused_loss_bytes(min(x.logits_chunk, R), args.vocab_size, args.dim, c)
    block = block_saved_bytes_per_token(
        args, compute_bytes=c, mask=False, device="cuda", packed=True
    )
    block *= T
    backward = 4 * T * args.dim + block  # the hidden gradient and the recomputed block
    assert b - a == c * T * S + max(fused, backward + repeat * T) - max(fused, backward)


def test_switches_shrink_what_they_should():
    base = _plan(_run_cfg())
    opt8 = _plan(_run_cfg(optimizer={"_component_": "torchao.optim.AdamW8bit"}))
    noac = _plan(_run_cfg(activation_checkpointing=False))
    ewma = _plan(_run_cfg(correction={"_component_": "minippo.rl.correction.EWMA"}))
    ewma_host = _plan(
        _run_cfg(correction={"_component_": "minippo.rl.correction.EWMA", "swap_storage": "cpu"})
    )
    sleep = _plan(
        _run_cfg(
            engine={
                "_component_": "minippo.engine.sglang_engine.SGLangEngine",
                "mem_fraction_static": 0.35,
                "memory_mode": "sleep",
            }
        )
    )

    def item(plan, name):
        return next(i for i in plan.items if i.name == name)

    ratio = (
        item(opt8, "actor optimizer states").device / item(base, "actor optimizer states").device
    )
    assert 0.24 < ratio < 0.27  # ~2.03 of 8 bytes per parameter
    assert item(noac, "actor activations").device > 3 * item(base, "actor activations").device
    # the whole per-rank batch (rollout.groups_per_batch x samples / ranks) scored in one forward
    whole = _plan(
        _run_cfg(
            rollout={
                "max_new_tokens": 8192,
                "max_staleness": 2,
                "partial_rollout": True,
                "groups_per_batch": 64,
                "samples_per_prompt": 8,
            },
            ppo={"micro_batch_size": 1},
        )
    )
    assert whole.inputs.score_rows == 64 and whole.peak_phase == "score"
    assert (
        item(whole, "no-grad scoring passes").device
        > 10 * item(base, "no-grad scoring passes").device
    )
    assert item(ewma, "correction (EWMA)").device > 0 and ewma.host_total == 0
    # swap_storage: cpu moves the swap buffer (one master-dtype copy of the shards) to the host
    moved = item(ewma, "correction (EWMA)").device - item(ewma_host, "correction (EWMA)").device
    # in pinned host memory, each tensor's block rounded up to a power of two
    assert int(moved * ewma_host.pinned_factor) == item(ewma_host, "correction (EWMA)").host
    assert moved > 0 and ewma_host.pinned_factor > 1
    assert ewma_host.device_total == ewma.device_total - moved
    # rollout.mode decides whether the engine's share is alive while training, not memory_mode
    # (the phases of rollout.mode=alternate: tests/unit/test_memory_plan_modes.py)
    assert sleep.device_total == base.device_total
    small = _plan(_run_cfg(), gpu=20)
    assert small.fits is False
    assert "DOES NOT FIT" in small.table()


def test_missing_or_bad_keys_are_named():
    cfg = _run_cfg()
    del cfg["ppo"]
    with pytest.raises(ConfigError, match=r"the config has no ppo\.micro_batch_size"):
        plan_from_config(cfg)
    cfg = _run_cfg()
    del cfg.dataset["max_prompt_tokens"]
    with pytest.raises(ConfigError, match=r"dataset\.max_prompt_tokens"):
        plan_from_config(cfg)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        plan_from_config(_run_cfg(checkpoint_path="/nonexistent/my-model"))  # no released size
    with pytest.raises(ConfigError, match="no model of this optimizer"):
        plan_from_config(_run_cfg(optimizer={"_component_": "torch.optim.SGD"}))
    with pytest.raises(ConfigError, match="dtype='float8'"):
        plan_from_config(_run_cfg(dtype="float8"))
    with pytest.raises(ConfigError, match=r"calling minippo\.models\.Transformer failed"):
        plan_from_config(_run_cfg(model={"_component_": "minippo.models.Transformer"}))
    with pytest.raises(ConfigError, match="not ModelArgs"):
        plan_from_config(_run_cfg(model={"_component_": "minippo.models.TinyTokenizer"}))


def test_llama_and_tied_models_plan_without_allocating():
    # a model far too large to allocate here is planned from shapes on the meta device
    cfg = _run_cfg(
        model={"_component_": "minippo.models.qwen3_8b"}, correction={"_component_": FAKE}
    )
    plan = _plan(cfg)
    assert plan.items[0].device > 3.5e9  # 8.2B fp32 / 8
    cfg = _run_cfg(
        model={"_component_": "minippo.models.llama3_2_1b"}, correction={"_component_": FAKE}
    )
    plan = plan_from_config(cfg)
    assert plan.items[0].device > 0 and llama3_2_1b().tie_word_embeddings


def test_plan_command_prints_the_table_and_exit_code(capsys, tmp_path):
    from minippo._cli.plan import add_plan_parser

    path = tmp_path / "run.yaml"
    path.write_text(OmegaConf.to_yaml(_run_cfg(correction={"_component_": FAKE})))
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "plan",
            "--formula-only",
            "--config",
            str(path),
            "gpu_mem_gib=141",
            "ppo.micro_batch_size=2",
        ]
    )
    code = args.func(args)
    out = capsys.readouterr().out
    assert "micro_batch 2" in out and ("FITS" in out) == (code == 0)
    args = parser.parse_args(
        ["plan", "--formula-only", "--config", str(path), "gpu_mem_gib=8", "nproc_per_node=8"]
    )
    assert args.func(args) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    args = parser.parse_args(["plan", "--formula-only", "--config", str(path), "gpu_mem_gib=lots"])
    with pytest.raises(ConfigError, match="must be a number"):
        args.func(args)


SHIPPED = {  # config -> (size builder standing in for its HF folder, ranks)
    "qwen3_4b_dapo_math_8gpu": ("minippo.models.qwen3_4b", 8),
    "qwen3_0_6b_gsm8k_1gpu": ("minippo.models.qwen3_0_6b", 1),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_gpu_configs_fit_with_checkpointing_and_micro_batched_scoring(name):
    if not (REPO / "configs" / f"{name}.yaml").exists():
        pytest.skip(f"configs/{name}.yaml is not in this checkout")
    builder, ranks = SHIPPED[name]
    cfg = load_config(name, ["checkpoint_path=null", f"model={{_component_: {builder}}}"])
    cfg.activation_checkpointing = True
    # the no-grad passes scored in micro-batches, not the whole per-rank batch in one forward
    cfg.ppo.score_micro_batch_size = cfg.ppo.micro_batch_size
    plan = plan_from_config(cfg, gpu_mem_gib=80, world_size=ranks)
    assert plan.inputs.device == "cuda"
    assert plan.fits, plan.table()


def _item(plan, prefix):
    return next(i for i in plan.items if i.name.startswith(prefix))


def test_the_correction_item_is_what_the_class_declares():
    node = OmegaConf.create({"_component_": FAKE, "storage_dtype": "bf16"})
    cost = correction_cost(node, max_staleness=2, partial_rollout=True)
    assert cost.name == "FakeSnapshots" and cost.scoring_passes == 1
    # the node's options reach the class; what the node omits is the class's default
    assert cost.stored == (
        WeightCopies("snapshots", 4, "bf16", "accelerator"),
        WeightCopies("scratch", 1, None, "accelerator"),
    )
    # storage (default "accelerator") could move to the host; bf16 is already 2 bytes
    assert [override for override, _ in cost.switches] == ["correction.storage=cpu"]

    # in a plan: copies x P x dtype bytes (None: the fp32 master weights), device or host
    plan = _plan(_run_cfg(correction=node))  # max_staleness 2 + 1, partial rollouts + 1
    P = plan.actor_numel
    assert _item(plan, "correction").device == 4 * P * 2 + P * 4
    assert _item(plan, "correction").host == 0
    host = _plan(_run_cfg(correction={"_component_": FAKE, "storage": "cpu"}))
    assert (_item(host, "correction").device, _item(host, "correction").host) == (
        4 * P,
        int(4 * P * 4 * host.pinned_factor),
    )
    # the switches are the advice, with the bytes they save
    many = _plan(
        _run_cfg(
            correction={"_component_": FAKE},
            rollout={"max_new_tokens": 8192, "max_staleness": 8, "partial_rollout": False},
        )
    )
    saved = 9 * P * 4
    assert f"correction.storage=cpu ({saved / GiB:.2f} GiB less on the device" in many.table()
    moved = _plan(
        _run_cfg(
            correction={"_component_": FAKE, "storage": "cpu"},
            rollout={"max_new_tokens": 8192, "max_staleness": 8, "partial_rollout": False},
        )
    )
    assert f"host: correction.storage_dtype=bf16 stores {9 * P * 2 / GiB:.2f} GiB less" in (
        moved.table()
    )


def test_no_actor_scoring_pass_when_the_class_needs_none():
    def scoring(**over):
        return _item(_plan(_run_cfg(advantage_estimator="grpo", **over)), "no-grad")

    assert scoring(correction={"_component_": FAKE, "passes": 0}).note == "none"
    assert scoring(correction={"_component_": FAKE, "passes": 0}).device == 0
    assert scoring(correction={"_component_": FAKE}).device > 0
    # the reference model is scored whatever the correction needs
    ref = scoring(correction={"_component_": FAKE, "passes": 0}, kl={"coef": 0.1})
    assert ref.device > 0


def test_a_correction_class_without_the_interface_is_named():
    cfg = _run_cfg(correction={"_component_": "minippo.models.Transformer"})
    with pytest.raises(ConfigError, match=r"minippo\.models\.Transformer has no stored_weights"):
        plan_from_config(cfg)


def test_engine_options_the_config_omits_come_from_the_engine_class():
    import inspect

    from minippo.engine.sglang_engine import SGLangEngine

    default = inspect.signature(SGLangEngine).parameters["mem_fraction_static"].default
    engine = {"_component_": "minippo.engine.sglang_engine.SGLangEngine"}
    plan = _plan(_run_cfg(engine=engine, correction={"_component_": FAKE}))
    assert plan.inputs.device == "cuda"  # an engine that takes a share of GPU memory
    assert _item(plan, "engine").device == int(default * 141 * GiB)
    # TorchEngine takes no share of GPU memory: a CPU plan without an engine item
    torch_engine = {"_component_": "minippo.engine.torch_engine.TorchEngine"}
    plan = _plan(_run_cfg(engine=torch_engine, correction={"_component_": FAKE}))
    assert plan.inputs.device == "cpu" and not any(i.name.startswith("engine") for i in plan.items)


def test_mixed_precision_on_one_rank_keeps_fp32_master_weights():
    # dtype=bf16 on one rank is FSDP2 mixed precision (torchrun --nproc-per-node 1): fp32 master
    # weights and bf16 all-gathered copies, as on 8 ranks
    cfg = _run_cfg(correction={"_component_": FAKE})
    plan = plan_from_config(cfg, gpu_mem_gib=141, world_size=1)
    n = sum(math.prod(s) for s in model_param_shapes(qwen3_4b()))
    assert _item(plan, "actor parameters").device == n * 4
    assert _item(plan, "actor FSDP working set").device > 0
    fp32 = plan_from_config(_run_cfg(dtype="fp32", correction={"_component_": FAKE}))
    assert not any("FSDP" in i.name for i in fp32.items)


def _tiny_cfg(*over):
    return load_config(
        TINY,
        ["~correction", f"+correction._component_={FAKE}", "ppo.score_micro_batch_size=16", *over],
    )


# token budgets that are no multiple of the toy task's 10-token rows: a shorter last row
BUDGETS = (
    "ppo.micro_batch_size=null",
    "ppo.max_tokens_per_micro_batch=57",
    "ppo.score_micro_batch_size=null",
    "ppo.score_max_tokens_per_micro_batch=150",
)


@pytest.mark.skipif(not TINY.exists(), reason="needs configs/tiny_cpu.yaml")
@pytest.mark.parametrize(
    ("ranks", "dtype", "over"),
    [
        (1, "fp32", ()),
        (2, "bf16", ()),
        (1, "fp32", BUDGETS),
        (1, "fp32", ("ppo.pack=false",)),
    ],
)
def test_the_fake_tensor_step_allocates_what_the_real_step_does(ranks, dtype, over):
    """One recipe step of tiny_cpu (actor, critic, AdamW, activation checkpointing, the fake
    correction's stored copies, the fused policy loss; on 2 ranks FSDP2 over the
    fake process group in bf16; packed, also with token budgets, and padded):
    FakeTensorMode gives every tensor its real shape and dtype and only leaves out the data, and
    the same ops run on the same shapes, so the peak of live bytes is the same to the byte as on
    real tensors."""
    cfg = _tiny_cfg("activation_checkpointing=true", f"dtype={dtype}", *over)
    fake = measure_from_config(cfg, world_size=ranks)
    real = measure_from_config(cfg, world_size=ranks, fake=False)
    assert fake.peak == real.peak > 0
    assert fake.by_kind == real.by_kind
    assert sum(fake.by_kind.values()) == fake.peak
    # the formula counts the same things: within its 15%
    plan = plan_from_config(cfg, world_size=ranks)
    assert abs(plan.tensor_total / fake.peak - 1) < 0.15, (plan.tensor_total, fake.peak)


@pytest.mark.skipif(not TINY.exists(), reason="needs configs/tiny_cpu.yaml")
def test_plan_command_takes_its_totals_from_the_measured_step(capsys):
    from minippo._cli.plan import add_plan_parser

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    over = ["~correction", f"+correction._component_={FAKE}"]
    args = parser.parse_args(["plan", "--config", "tiny_cpu", *over])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "trainer total, measured" in out and "one recipe step on fake tensors (cpu" in out
    assert "at the measured peak (MiB, device and host): parameter" in out
    # the same config's plan with the measured step attached: its totals are the step's peak
    cfg = load_config(TINY, over)
    plan = plan_from_config(cfg)
    plan.measured = measure_from_config(cfg)
    assert plan.trainer_total == plan.measured.peak != plan.formula_trainer_total
    assert f"{plan.measured.peak / 2**20:.2f}" in out


def test_plan_inputs_need_the_recipe_keys():
    cfg = _run_cfg(correction={"_component_": FAKE})
    del cfg["advantage_estimator"]
    with pytest.raises(ConfigError, match="no advantage_estimator"):
        plan_inputs_from_config(cfg)
    with pytest.raises(ValueError, match="advantage_estimator must be one of"):
        plan_inputs_from_config(_run_cfg(advantage_estimator="rloo"))


def test_a_released_size_is_planned_without_its_download(tmp_path, capsys):
    from minippo.plan.config import builder_for_folder

    assert builder_for_folder("/models/Qwen3-0.6B") == "qwen3_0_6b"
    assert builder_for_folder("/m/Qwen2.5-0.5B") == "qwen2_5_0_5b"
    assert builder_for_folder("/m/Llama-3.2-1B") == "llama3_2_1b"
    assert builder_for_folder(tmp_path / "my-model") is None
    from minippo.config import load_config
    from minippo.models import qwen3_0_6b
    from minippo.plan import config as plan_config
    from minippo.plan.config import plan_inputs_from_config

    plan_config._NOT_DOWNLOADED_TOLD.clear()  # said once per process: another test may have
    cfg = load_config("qwen3_0_6b_gsm8k_1gpu", [])
    inputs = plan_inputs_from_config(cfg)
    assert inputs.actor == qwen3_0_6b()
    assert "planning the shape of minippo.models.qwen3_0_6b" in capsys.readouterr().err
    with pytest.raises(ValueError, match="qwen3_0_6b, qwen3_1_7b"):
        plan_inputs_from_config(
            load_config("qwen3_0_6b_gsm8k_1gpu", [f"checkpoint_path={tmp_path}"])
        )


def _local_numels(args, world_size: int) -> list[int]:
    return [local_numel(s, world_size) for s in model_param_shapes(args)]


def test_pinned_rounding_is_powers_of_two_per_tensor():
    assert pinned_rounding([4096, 1024]) == 1.0
    assert pinned_rounding([3000]) == pytest.approx(4096 / 3000)
    assert pinned_rounding([3, 5]) == pytest.approx((4 + 8) / 8)
    assert pinned_rounding([]) == 1.0


def test_fused_loss_bytes_count_what_the_fused_pass_holds():
    V, D, n = 151936, 2560, 1024
    # bf16: the fp32 accumulator + the larger of (z, p fp32) and (dz bf16 + a chunk's bf16 and
    # fp32 [V, D] gradient)
    bf16 = fused_loss_bytes(n, V, D, 2)
    assert bf16 == 4 * V * D + max(8 * n * V, 2 * n * V + 6 * V * D)
    assert bf16 / GiB == pytest.approx(3.91, abs=0.01)
    # fp32: z and p only (the accumulator is the gradient itself, dz is p in place)
    assert fused_loss_bytes(n, V, D, 4) == 8 * n * V


@pytest.mark.parametrize(("dtype", "c"), [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize(("V", "D", "n", "R"), [(4096, 64, 32, 64), (512, 256, 16, 48)])
def test_fused_loss_bytes_equal_the_fused_pass_peak_on_cpu(dtype, c, V, D, n, R):
    """The peak of live bytes the fused pass adds to its inputs: fused_loss_bytes + the hidden
    gradient c·R·D (+ in fp32 the lm_head gradient c·V·D, which the accumulator is), within the
    per-token vectors (logprobs, entropies, prepared inputs: < 64 bytes a token)."""
    from minippo.models.fused_policy_loss import FusedLossSpec, fused_policy_loss_from_hidden

    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, R, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.02).to(dtype).requires_grad_()
    y = torch.randint(0, V, (1, R), generator=g)
    spec = FusedLossSpec(
        anchor_logprobs=torch.full((1, R), -5.0),
        advantages=torch.randn(1, R, generator=g),
        response_mask=torch.ones(1, R),
        entropy_coef=0.01,
    )
    tracker = TensorMemoryTracker()
    tracker.track(h, w, y, spec.anchor_logprobs, spec.advantages, spec.response_mask)
    base = tracker.current["cpu"]
    with tracker:
        fused_policy_loss_from_hidden(h, w, y, spec, chunk_size=n)
    expected = fused_loss_bytes(n, V, D, c) + c * R * D + (c * V * D if c == 4 else 0)
    assert 0 <= tracker.peak["cpu"] - base - expected < 64 * R
