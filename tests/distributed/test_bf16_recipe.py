"""The GPU configs' precision, on CPU: the recipe under FSDP2 with bf16 compute, fp32 master weights
and fp32 gradient reduction (``dtype: bf16`` under a process group, as both GPU configs run), on 1
and 2 gloo ranks, for every correction. What users rely on there, checked on one step:

* every tensor of the policy loss's spec (anchors, advantages, IS weights, keep-mask, response
  mask, global token and sequence counts) reaches the loss inside the model's forward in the dtype
  and with the values the recipe built it with. FSDP2's mixed precision casts the floating tensors
  of a module's forward inputs to bf16 unless told not to, dataclasses included: an anchor of −5.3
  read as −5.3125 is a ratio of 1.013 on an on-policy token, a token count of 20011 reads 19968;
* an on-policy first update (each correction whose anchor at step 0 is the policy that sampled)
  has ratio 1 exactly and clips nothing, as the loss itself sees it: with one row per forward the
  anchors come from the same bf16 passes, with the same shapes, as the update's own logprobs (two
  identical computations: equal bit for bit on any CPU);
* the reference model (the actor's weights at step 0) gives a KL of exactly 0 on that update;
* keep_old_actor's anchors are the snapshot's scoring of the same rows in the same precision, bit
  for bit (the recipe's own scoring function, run again on the snapshot's weights);
* EWMA's θ̄ stays fp32 and its update is the fp32 lerp of the fp32 master weights, bit for bit;
* the update's logprobs, policy loss and gradient agree with an fp32 reference (the same weights
  and inputs, fp32 compute, unsharded; on 2 ranks the ranks' reference gradients summed) to the
  bf16 scale (``bound`` below), and the master weights and their gradients stay fp32.

Tolerances (the bf16 ones, as tests/unit/test_packing.py derives them): in bf16 every op's output
rounds to 8 bits (u = 2⁻⁸), about 16 roundings per decoder block and 3 outside (embedding, final
norm, lm_head), so a forward output is within (16·L + 3)·u·scale of its exact value, scale the
largest magnitude involved; the fp32 reference is exact at that scale. A logprob z_t − lse(z) takes
the error of two logits (scale: max |z|); the backward rounds as often again, so a gradient is
within 2·(16·L + 3)·u·max|g|. A loss moves by at most Σ_t |∂loss/∂lp_t|·δ_lp·e^δ_lp for logprob
errors of at most δ_lp. A real mistake (a wrong dtype on a path, an input read as another one)
moves these by O(scale) or shows as a changed dtype or value.

The recipe is driven with fixed rollouts (tests.helpers.recipe_on_fixed_batches); each rank trains
on its own rows. Every correction runs in one spawned group per world size (spawning is the cost).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from minippo.config import load_config
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    SWITCH_CORRECTION,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
    run_on_ranks,
    shared_process_group,
)

U_BF16 = torch.finfo(torch.bfloat16).eps / 2  # unit roundoff of bf16, 2⁻⁸
ROUNDINGS_PER_BLOCK = 16  # as tests/unit/test_packing.py counts them
CORRECTIONS = {
    **SWITCH_CORRECTION,
    # with a reference model and the KL in the loss (the reference starts as the actor)
    "TIS": [*SWITCH_CORRECTION["TIS"], "kl.coef=0.05", "kl.mode=loss", "kl.estimator=k3"],
}
# the corrections whose anchor at step 0 is the actor that sampled: the first update is on-policy
ON_POLICY_AT_START = ("EWMA", "TIS", "KeepOldActor")
# 2 minibatches (the second trains after an optimizer step); every forward, scoring or update,
# holds one row, so the update's logprobs and the anchors scored before it are the same passes
# over the same tokens with the same shapes: equal bit for bit on any CPU
OVERRIDES = [
    *FIXED_BATCH_OVERRIDES,
    "dtype=bf16",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=1",
    "ppo.score_micro_batch_size=1",
]
SPEC_TENSORS = (
    "anchor_logprobs",
    "advantages",
    "response_mask",
    "weights",
    "keep_mask",
    "global_tokens",
    "global_seqs",
    "ref_logprobs",
)


def forward_rounding(n_layers: int) -> float:
    """(16·L + 3)·u: the relative error of a bf16 forward output (module docstring)."""
    return (ROUNDINGS_PER_BLOCK * n_layers + 3) * U_BF16


def _tensors(spec) -> dict[str, torch.Tensor]:
    return {k: getattr(spec, k) for k in SPEC_TENSORS if torch.is_tensor(getattr(spec, k))}


def _full_grads(model) -> dict[str, torch.Tensor]:
    """{name: full gradient} (a collective for sharded parameters: every rank calls it)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _fp32_reference(args, weights, input_ids, spec, kw) -> dict:
    """The first micro-batch's fused policy loss on an unsharded fp32 model with ``weights``:
    logprobs, loss, ∂loss/∂lp (autograd through ``rl.policy_loss``), parameter gradients."""
    import torch.distributed as dist

    import minippo.models as models
    import minippo.rl as rl
    from minippo.models import Transformer

    ref = Transformer(args)
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}  # tied to the embedding
    assert not missing or ref.output.weight is ref.tok_embeddings.weight
    layout = kw.get("packed")
    kw = {**kw, "packed": None if layout is None else layout.to(torch.device("cpu"))}
    out = models.fused_policy_loss(ref, input_ids, spec, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    if dist.is_initialized():  # the ranks' shares add up to the global loss's gradient
        for g in grads.values():
            dist.all_reduce(g)
    dloss_dlp = None  # anchors formed token by token inside the pass: no fixed anchor tensor
    if spec.anchor_logprobs is not None:
        lp = out.logprobs.clone().requires_grad_(True)
        loss, _ = rl.policy_loss(
            lp, spec.anchor_logprobs, spec.advantages, spec.response_mask,
            eps_low=spec.eps_low, eps_high=spec.eps_high, dual_clip=spec.dual_clip,
            weights=spec.weights, keep_mask=spec.keep_mask, agg_mode=spec.agg_mode,
            global_tokens=spec.global_tokens, global_seqs=spec.global_seqs,
        )  # fmt: skip
        (dloss_dlp,) = torch.autograd.grad(loss, lp)
    with torch.no_grad():
        logits = ref(
            input_ids, attention_mask=kw["attention_mask"], position_ids=kw["position_ids"]
        )
    return {
        "lp": out.logprobs, "loss": out.loss.detach(), "dloss_dlp": dloss_dlp, "grads": grads,
        "max_logit": float(logits.abs().max()),
    }  # fmt: skip


def run_correction(out: Path, name: str, rank: int, world: int) -> dict:
    """One bf16 step of the recipe with ``name``'s correction; returns what the checks read."""
    import minippo.models as models
    import minippo.models.model as model_module
    from minippo.parallel import gather_full_state_dict
    from minippo.parallel.weight_swap import local_shards

    cfg = load_config(
        "tiny_cpu", [*OVERRIDES, *CORRECTIONS[name], f"output_dir={out}/{name}-{world}"]
    )
    built, inside, fused_out, first = [], [], [], {}
    real_fused, real_from_hidden = (
        models.fused_policy_loss,
        model_module.fused_policy_loss_from_hidden,
    )

    def recording_fused(model, input_ids, spec, **kw):  # the recipe's call, outside the model
        built.append(spec)
        if not first:  # the first micro-batch: the fp32 reference's weights and inputs
            full = gather_full_state_dict(model)  # may share storage with the parameters
            first.update(
                weights={k: v.clone() for k, v in full.items()}, call=(input_ids, spec, kw)
            )
        fused_out.append(real_fused(model, input_ids, spec, **kw))
        return fused_out[-1]

    def recording_from_hidden(hidden, weight, targets, spec, **kw):  # inside the model's forward
        inside.append(spec)
        return real_from_hidden(hidden, weight, targets, spec, **kw)

    result: dict = {"name": name}
    models.fused_policy_loss = recording_fused
    model_module.fused_policy_loss_from_hidden = recording_from_hidden
    try:
        with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
            batch = fixed_rollout_batch(recipe.actor.args, actor_seed=cfg.seed, mu_noise=0.5)
            corr = recipe.correction
            real_prepare, real_after = corr.prepare, corr.after_optimizer_step
            real_backward = recipe._actor_backward
            n_before_step = []  # fused passes before the first optimizer step

            def prepare(b, actor, *, step):
                prep = real_prepare(b, actor, step=step)
                if name == "KeepOldActor":  # the actor holds the snapshot of version 0 now
                    with torch.no_grad():
                        lp = recipe._scored(partial(recipe._logprobs, actor), b)
                    result["koa"] = (prep.anchor_logprobs.clone(), lp, b.response_mask.clone())
                return prep

            def after_optimizer_step(actor):
                if not n_before_step:
                    n_before_step.append(len(built))
                if name == "EWMA" and "ewma" not in result:
                    before = [t.clone() for t in corr.theta_bar]
                    real_after(actor)
                    theta = [t.clone() for t in local_shards(actor)]
                    after = [t.clone() for t in corr.theta_bar]
                    result["ewma"] = (before, theta, after, 1.0 / corr.n)
                else:
                    real_after(actor)

            def actor_backward(*a):
                res = real_backward(*a)
                if "grads" not in first:  # after the first micro-batch's backward
                    first["grads"] = _full_grads(recipe.actor)
                    first["master"] = {n: p.dtype for n, p in recipe.actor.named_parameters()}
                return res

            corr.prepare, corr.after_optimizer_step = prepare, after_optimizer_step
            recipe._actor_backward = actor_backward
            recipe.train()
            args = recipe.actor.args
    finally:
        models.fused_policy_loss = real_fused
        model_module.fused_policy_loss_from_hidden = real_from_hidden

    result["n_layers"] = args.n_layers
    result["n_specs"] = (len(built), len(inside))
    # the dtypes and values the loss received, against those the recipe built
    result["spec_pairs"] = [
        {k: (b[k].dtype, i[k].dtype, torch.equal(b[k], i[k].to(b[k].dtype))) for k in b}
        for b, i in ((_tensors(s), _tensors(t)) for s, t in zip(built, inside))
    ]
    # the first minibatch's passes: log-ratios to the anchors, clip fractions
    n = n_before_step[0]
    result["first_logratio"] = [
        (res.logprobs - s.anchor_logprobs)[s.response_mask > 0]
        for s, res in zip(built[:n], fused_out[:n])
        if s.anchor_logprobs is not None
    ]
    # ... and what the loss itself saw: clip fractions, ratio mean and max, approximate KL
    result["first_stats"] = [
        {
            "clip": float(st.clip_frac_low + st.clip_frac_high + st.dual_clip_frac),
            "ratio_mean": float(st.ratio_mean), "ratio_max": float(st.ratio_max),
            "approx_kl": float(st.approx_kl),
        }
        for st in (res.stats for res in fused_out[:n])
    ]  # fmt: skip
    # the KL to the reference, which holds the actor's weights at step 0
    result["first_kl"] = [float(r.kl_stats.kl_mean) for r in fused_out[:n] if r.kl_stats]
    result["master_dtypes"] = first["master"]
    input_ids, spec, kw = first["call"]
    result["fp32"] = _fp32_reference(args, first["weights"], input_ids, spec, kw)
    result["bf16"] = {
        "lp": fused_out[0].logprobs, "loss": fused_out[0].loss.detach().float(),
        "mask": spec.response_mask > 0, "grads": first["grads"],
    }  # fmt: skip
    return result


def _on_ranks(rank: int, world: int, out: str) -> None:
    with shared_process_group():
        results = [run_correction(Path(out), name, rank, world) for name in CORRECTIONS]
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def results(request, tmp_path_factory) -> list[dict]:
    """Every rank's record of every correction (``run_correction``)."""
    out = tmp_path_factory.mktemp(f"bf16-{request.param}")
    run_on_ranks(_on_ranks, str(out), world_size=request.param)
    per_rank = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(request.param)]
    return [r for rank in per_rank for r in rank]


def test_loss_inputs_reach_the_loss_in_the_dtype_the_recipe_built(results):
    for r in results:
        n_built, n_inside = r["n_specs"]
        assert n_built == n_inside > 0, r["name"]
        for pairs in r["spec_pairs"]:
            assert pairs["advantages"][0] == torch.float32  # the recipe builds them in fp32
            for key, (built, inside, equal) in pairs.items():
                assert inside == built, f"{r['name']}: {key} is {inside} in the loss, not {built}"
                assert equal, f"{r['name']}: {key} changed value on its way into the loss"


def test_an_on_policy_first_update_has_ratio_one_and_clips_nothing(results):
    on_policy = {"clip": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "approx_kl": 0.0}
    for r in results:
        if r["name"] not in ON_POLICY_AT_START:
            continue
        assert r["first_logratio"] and r["first_stats"], r["name"]
        for logr in r["first_logratio"]:  # the update's logprobs equal the anchors built
            assert torch.equal(logr, torch.zeros_like(logr)), f"{r['name']}: ratio != 1"
        for stats in r["first_stats"]:  # and the loss saw exactly those anchors
            assert stats == on_policy, f"{r['name']}: the loss saw {stats}"
        # the reference model scores the same passes as the actor: KL 0 before the first step
        assert r["first_kl"] == [0.0] * len(r["first_kl"]), r["name"]
    assert any(r["first_kl"] for r in results)  # the reference model ran


def test_keep_old_actor_anchors_are_the_snapshots_scoring_in_the_same_precision(results):
    (koa,) = [r["koa"] for r in results if r["name"] == "KeepOldActor"][:1]
    anchors, scored, mask = koa
    m = mask > 0
    assert anchors.dtype == scored.dtype == torch.float32
    assert torch.equal(anchors[m], scored[m])


def test_ewma_theta_bar_update_is_fp32_math(results):
    for r in results:
        if r["name"] != "EWMA":
            continue
        before, theta, after, weight = r["ewma"]
        assert {t.dtype for t in [*before, *theta, *after]} == {torch.float32}
        for b, t, a in zip(before, theta, after):
            assert torch.equal(a, torch.lerp(b, t, weight))  # θ̄ + (θ − θ̄)/n, in fp32


def test_master_weights_and_their_gradients_stay_fp32(results):
    for r in results:
        assert set(r["master_dtypes"].values()) == {torch.float32}, r["name"]
        assert {g.dtype for g in r["bf16"]["grads"].values()} == {torch.float32}, r["name"]


def test_update_agrees_with_an_fp32_reference_to_the_bf16_scale(results):
    for r in results:
        bf, ref, rel = r["bf16"], r["fp32"], forward_rounding(r["n_layers"])
        m = bf["mask"]
        lp_bound = 2 * rel * ref["max_logit"]  # a logprob: the errors of two logits
        lp_err = float((bf["lp"] - ref["lp"])[m].abs().max())
        assert lp_err <= lp_bound, f"{r['name']}: logprobs {lp_err} > {lp_bound}"
        if ref["dloss_dlp"] is not None:  # |Δloss| ≤ Σ|∂loss/∂lp|·δ·e^δ
            slope = float(ref["dloss_dlp"].abs().sum())
            loss_bound = slope * lp_bound * math.exp(lp_bound)
            loss_err = float((bf["loss"] - ref["loss"]).abs())
            assert loss_err <= loss_bound, f"{r['name']}: loss {loss_err} > {loss_bound}"
        for name, g_ref in ref["grads"].items():
            g = bf["grads"][name]
            bound = 2 * rel * float(g_ref.abs().max())
            err = float((g - g_ref).abs().max())
            assert err <= bound, f"{r['name']}: gradient of {name} off by {err} > {bound}"


def _critic_values(rank: int, world: int, out: str) -> None:
    """A critic sharded with bf16 compute, its value head non-zero: its values and the fp32 head
    applied to the same bf16 hidden states."""
    from torch.distributed.tensor import distribute_tensor

    import minippo.parallel as parallel
    from minippo.models import ValueModel, init_weights, qwen3_tiny
    from minippo.models.packing import pack

    parallel.init_distributed()
    args = qwen3_tiny(51)
    batch = fixed_rollout_batch(args)
    with torch.device("meta"):
        critic = ValueModel(args)
    parallel.shard_model(critic, param_dtype=torch.bfloat16, sum_gradients=True)
    critic.to_empty(device="cpu")
    init_weights(critic, seed=1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        head = critic.value_head.weight
        full = 0.5 * torch.randn(head.shape, generator=g)
        if hasattr(head, "device_mesh"):  # this rank's shard of it
            full = distribute_tensor(full, head.device_mesh, head.placements, src_data_rank=None)
        head.copy_(full)
        kw = dict(attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        layout = pack(batch.attention_mask)
        hidden = []  # the final norm's outputs: the hidden states the head reads
        hook = critic.norm.register_forward_hook(lambda mod, inp, out: hidden.append(out))
        values = {
            "padded": critic(batch.input_ids, **kw),
            "packed": critic(batch.input_ids, packed=layout, **kw),
        }
        hook.remove()
        w = critic.value_head.weight
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        w = w.to(torch.bfloat16).float().squeeze(0)  # as the forward computes with it
        shape = batch.input_ids.shape  # the padded pass's norm output is [B·S, D]
        fp32_head, magnitude = {}, {}
        for (name, h), to_batch in zip(
            zip(values, hidden), [lambda x: x.view(shape), layout.scatter]
        ):
            assert h.dtype == torch.bfloat16  # the compute dtype
            fp32_head[name] = to_batch(h.float() @ w)  # bias 0
            magnitude[name] = to_batch(h.float().abs() @ w.abs())  # Σ|terms| of each dot
    torch.save({"values": values, "fp32_head": fp32_head, "magnitude": magnitude,
                "dim": args.dim, "mask": batch.attention_mask},
               Path(out) / f"critic{rank}.pt")  # fmt: skip
    parallel.destroy_distributed()


def test_critic_values_are_not_rounded_to_bf16(tmp_path):
    """The critic's values feed the returns, the advantages and the value loss: under bf16 compute
    its head still runs in fp32 on the bf16 hidden states and bf16 compute weights (a bf16 head
    would round each value to 8 bits: ±2⁻⁹ relative), so the values equal that fp32 product to
    fp32 rounding (a D-term dot: D·u₃₂·Σ|terms|) and are not bf16 numbers."""
    run_on_ranks(_critic_values, str(tmp_path), world_size=1)
    r = torch.load(tmp_path / "critic0.pt", weights_only=False)
    m = r["mask"]
    for name, v in r["values"].items():
        want = r["fp32_head"][name]
        tol = r["dim"] * torch.finfo(torch.float32).eps / 2 * r["magnitude"][name]
        assert v.dtype == torch.float32, name
        assert bool(((v - want).abs() <= tol)[m].all()), name
        rounded = v[m].to(torch.bfloat16).float()
        assert not torch.equal(rounded, v[m]), f"{name}: every value is a bf16 number"
