"""The measured plan: run one recipe step of the configured models on fake tensors and record the
peak of live tensor bytes.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` every tensor has its real shape, dtype
and storage size but no data, so a step of Qwen3-4B on 8 ranks "runs" on a laptop in well under
a minute. ``torch.distributed._tools.mem_tracker.MemTracker`` (what FSDP2's ``FSDPMemTracker``
builds on; that one takes a single root module and optimizer) counts every storage from
allocation to free, FSDP2's storage resizes included, and keeps the peak. The step follows the
recipe (recipes/async_ppo.py):

    setup          actor (+ critic, + frozen reference) built in fp32, activation checkpointing
                   and FSDP2 sharding (over a fake process group of ``world_size`` ranks) as
                   configured, the configured optimizers with their states
                   (``build_optimizer`` creates them at setup, as in the recipe), and the
                   correction's stored weights as its class declares them (``stored_weights``)
    step 2         no-grad passes over the rank's batch, ``score_rows`` sequences per forward:
                   reference logprobs, critic values, ``scoring_passes`` actor forwards
    step 4         one minibatch: per micro-batch the actor's ``fused_policy_loss`` backward
                   (the lm_head and the policy loss in one pass, the recipe's only path) and the
                   critic's ``value_loss`` backward (gradients accumulate), then the optimizer
                   steps and ``zero_grad`` (with ``ppo.max_update_kl``: the actor's step after a
                   copy of its parameters and optimizer states, then a copy of the stepped
                   parameters and a no-grad re-score, as for a step to shorten)

Packed passes (``ppo.pack``) pack every forward as the recipe does; a token budget's forward
holds sequences of the longest length and one shorter one that fills the budget exactly (the
most tokens a forward can carry). The layouts are made on the host from real masks.

Values read back to the host (``float(loss)`` for logging) have no data under fake tensors: they
read as 0, which decides no shape. Left out: the engine and the weight publish (the engine has its
own memory); the correction's own code (its weights are allocated as declared); and
``clip_grad_norm_``: over the fake process group it counts a copy of every FSDP2 gradient
(121 MiB for a 32M-parameter model on 2 fake ranks) that the real call does not allocate
(0.002 MiB on 2 gloo ranks), its real cost being one norm per parameter. On a machine without
CUDA the step runs the CPU kernels even for a GPU plan (fake CUDA tensors need a CUDA build of
torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minippo.config import ConfigError, torch_dtype
from minippo.plan.config import MASTER_DTYPE, _select, plan_inputs_from_config
from minippo.plan.formula import PlanInputs, forward_tokens, model_param_shapes
from minippo.training.update_bound import UpdateBound

__all__ = ["MeasuredPeak", "measure_from_config", "measure_step"]


@dataclass
class MeasuredPeak:
    """The peak of one measured step.

    Fields:
        peak:    bytes of live tensors at the peak, every device together (the trainer process:
                 GPU and pinned host memory on CUDA runs, RAM on CPU runs)
        by_kind: the same bytes by MemTracker's kind: Parameter, Gradient, Optstate,
                 Activation, Temp, Other (the correction's stored weights, inputs)
        device:  the device the step ran on ("cpu", or "cuda" where torch has CUDA)
        seconds: wall time of the measurement
    """

    peak: int
    by_kind: dict[str, int]
    device: str
    seconds: float


class _HostScalarsReadZero(TorchDispatchMode):
    """Answers ``aten._local_scalar_dense`` (``float(t)``, ``t.item()``) of a fake tensor without
    a known value with 0 of its kind: the step only logs these. Values the fake mode knows
    (constants such as the optimizer's step count) are read as they are."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException

        if func is not torch.ops.aten._local_scalar_dense.default:
            return func(*args, **(kwargs or {}))
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            t = args[0]
            return False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0


class _Call(nn.Module):
    """A fresh root module around one call of ``model``. MemTracker takes a second forward of the
    same root module for the next iteration and refuses it, and its ``reset_mod_stats`` between
    calls loses hooks still pending in backward; the step calls each model several times
    (scoring chunks, micro-batches), each time through its own ``_Call``, which must stay alive
    until the backward has run (the tracker holds it by weak reference)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


def _budget_mask(tokens: int, seq_len: int, response_len: int) -> torch.Tensor:
    """Bool[rows, seq_len] on the host: a forward of exactly ``tokens`` real tokens, sequences of
    the longest length and a last one with the rest (its prompt first, left-padded, then its
    response, right-padded)."""
    full, rest = divmod(tokens, seq_len)
    mask = torch.ones(full + (rest > 0), seq_len, dtype=torch.bool)
    if rest:
        P = seq_len - response_len
        prompt = min(rest, P)
        mask[-1] = False
        mask[-1, P - prompt : P + rest - prompt] = True
    return mask


def _batch(
    args: Any, rows: int, seq_len: int, response_len: int, device: str, mask: Any = None
) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, args.vocab_size, (rows, seq_len), device=device)
    if mask is None:
        mask = torch.ones(rows, seq_len, dtype=torch.bool, device=device)
    else:  # a copy made in the step (the recipe moves its batch to the device)
        mask = mask.to(device, copy=True)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask[:, seq_len - response_len :].float(),
        "rollout_logprobs": torch.zeros(rows, response_len, device=device),
    }


def _tracker() -> Any:
    """A ``MemTracker`` that keeps the peak of the totals only.

    Its module hooks stay (they count the parameters FSDP2 all-gathers and frees by resizing
    storages); its per-module peaks go: they cost a pass over every module seen so far, and a
    copy of the snapshot, on every op (minutes instead of seconds for a 4B model).
    """
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return PeakTracker()


def _forwards(x: PlanInputs, rows: int) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """(host mask, packed layout) of one scoring and one training forward: the mask of a token
    budget's forward (:func:`_budget_mask`; None without a budget: full rows), the layout of
    the forward's rows (None for padded passes)."""
    from minippo.models import pack

    S, P0 = x.seq_len, x.seq_len - x.response_len
    out = []
    for tokens, n_rows in ((x.score_tokens, x.score_rows or rows), (x.micro_tokens, x.micro_batch)):
        mask = None
        if x.packed and tokens is not None:
            mask = _budget_mask(forward_tokens(tokens, S), S, x.response_len)
        layout = None
        if x.packed:
            real = torch.ones(min(n_rows, rows), S, dtype=torch.bool) if mask is None else mask
            layout = pack(real, start=P0)
        out.append((mask, layout))
    return out[0], out[1]


def _rows(b: dict[str, torch.Tensor], i: int, n: int) -> dict[str, torch.Tensor]:
    return {k: v[i : i + n] for k, v in b.items()}


def measure_step(
    x: PlanInputs,
    *,
    compute_dtype: torch.dtype,
    optimizer: Any,
    critic_optimizer: Any = None,
    batch_rows: int | None = None,
    micro_batches: int = 2,
    device: str | None = None,
    fake: bool = True,
) -> MeasuredPeak:
    """The peak of one recipe step of ``x``'s models on fake tensors (see the module docstring).

    Args:
        x: the plan inputs (models, shapes, micro-batch, score rows, correction, ranks).
        compute_dtype: the recipe's ``dtype`` (FSDP2 ``param_dtype`` when sharded).
        optimizer / critic_optimizer: ``_component_`` nodes, built with ``build_optimizer``.
        batch_rows: sequences of the rank's step batch (None: ``x.score_rows``).
        micro_batches: micro-batches of gradient accumulation per minibatch that run (from the
            second one on the gradients of the first are alive: 2 reaches the peak of any more).
        device: "cuda" or "cpu"; None: cuda where available and ``x.device`` is cuda.
        fake: False runs the same step on real tensors (small models only: this checks the fake
            step against real allocations).
    """
    import contextlib

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    if device is None:
        device = "cuda" if x.device == "cuda" and torch.cuda.is_available() else "cpu"
    rows = batch_rows or x.score_rows or x.micro_batch
    if rows < micro_batches * x.micro_batch:
        raise ValueError(
            f"batch_rows ({rows}) must hold micro_batches ({micro_batches}) x micro_batch "
            f"({x.micro_batch}) sequences"
        )
    t0 = time.perf_counter()
    forwards = _forwards(x, rows)  # real host tensors, before the fake mode and the tracker
    mesh = None
    if x.sharded:
        if dist.is_initialized():
            raise RuntimeError(
                "measure_step shards over a fake process group of its own: call it outside "
                "torchrun / init_process_group"
            )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=x.world_size, store=FakeStore())
        mesh = init_device_mesh(device, (x.world_size,))  # outside the fake mode: real ranks
    try:
        with (
            # the packed layouts are real host tensors (made from real masks) among fake ones
            FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
            torch.device(device),
            torch.compiler.set_stance("force_eager"),  # torchao compiles its step
        ):
            models, opts, stored = _setup(x, mesh, compute_dtype, optimizer, critic_optimizer)
            tracker = _tracker()
            tracker.track_external(*[m for m in models if m is not None], *opts, *stored)
            with tracker, _HostScalarsReadZero():
                _step(x, *models, opts, rows, micro_batches, device, forwards)
            snap = tracker.get_tracker_snapshot("peak")
    finally:
        if mesh is not None:
            dist.destroy_process_group()
    by_kind: dict[str, int] = {}
    for dev_snap in snap.values():
        for kind, n in dev_snap.items():
            name = getattr(kind, "value", kind)
            if name != "Total":
                by_kind[name] = by_kind.get(name, 0) + int(n)
    peak = sum(int(dev_snap["Total"]) for dev_snap in snap.values())
    return MeasuredPeak(peak, by_kind, device, time.perf_counter() - t0)


def _setup(
    x: PlanInputs, mesh: Any, compute_dtype: torch.dtype, optimizer: Any, critic_optimizer: Any
) -> tuple[tuple[Any, Any, Any], list[Any], list[torch.Tensor]]:
    """(actor, critic, reference), the optimizers with their states, the correction's stored
    weights: what is alive when a step starts."""
    from minippo.models import Transformer, ValueModel
    from minippo.parallel import apply_activation_checkpointing, shard_model
    from minippo.training.optimizers import build_optimizer, local_numel

    def build(cls: type[nn.Module], args: Any, trainable: bool) -> nn.Module:
        model = cls(args).requires_grad_(trainable)  # fp32: torch's default dtype
        if trainable and x.activation_checkpointing:
            apply_activation_checkpointing(model)
        if mesh is not None:
            shard_model(model, mesh=mesh, param_dtype=compute_dtype)
        return model

    actor = build(Transformer, x.actor, True)
    critic = build(ValueModel, x.critic, True) if x.critic is not None else None
    ref = build(Transformer, x.actor, False) if x.reference else None
    # build_optimizer creates the states at once, as in the recipe's setup (materialize_state)
    opts = [build_optimizer(optimizer, actor.parameters())]
    if critic is not None:
        opts.append(build_optimizer(critic_optimizer or optimizer, critic.parameters()))
    P = sum(local_numel(s, x.world_size, 0) for s in model_param_shapes(x.actor))
    stored = [
        torch.empty(
            P,
            dtype=torch_dtype(w.dtype or MASTER_DTYPE, "correction stored_weights dtype"),
            device="cpu" if w.storage == "cpu" else None,
        )
        for w in x.correction.stored
        for _ in range(w.copies)
    ]
    return (actor, critic, ref), opts, stored


def _step(
    x: PlanInputs,
    actor: nn.Module,
    critic: nn.Module | None,
    ref: nn.Module | None,
    opts: list[Any],
    rows: int,
    micro_batches: int,
    device: str,
    forwards: tuple[tuple[Any, Any], tuple[Any, Any]],
) -> None:
    """Steps 2 and 4 of the recipe on one batch of ``rows`` sequences (see the module docstring).
    ``forwards``: (host mask, packed layout) of a scoring and of a training forward
    (:func:`_forwards`).

    Each no-grad pass runs one forward over ``score_rows`` sequences; the other chunks of the
    batch would repeat it exactly, so only their outputs are allocated before the concatenation.
    """
    from minippo.models import FusedLossSpec, fused_policy_loss, token_logprobs
    from minippo.rl import split_critic_values, value_loss

    P0, S = x.seq_len - x.response_len, x.seq_len
    (score_mask, score_layout), (micro_mask, mb_layout) = forwards
    n = min(x.score_rows or rows, rows) if score_mask is None else score_mask.shape[0]
    mb_rows = x.micro_batch if micro_mask is None else micro_mask.shape[0]
    batch = _batch(x.actor, max(rows, micro_batches * mb_rows, n), S, x.response_len, device)
    rows = batch["input_ids"].shape[0]
    mask = batch["response_mask"]
    # the recipe copies each layout to the device: a copy allocated in the step
    score_layout, mb_layout = (
        None if lay is None else lay.apply(torch.clone) for lay in (score_layout, mb_layout)
    )

    calls: list[_Call] = []

    def forward(fn: Any, model: nn.Module, b: dict[str, torch.Tensor], **kw: Any) -> Any:
        calls.append(_Call(model))
        return calls[-1](
            fn,
            b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"],
            **kw,
        )

    score_batch = _batch(x.actor, n, S, x.response_len, device, score_mask)

    def scored(fn: Any, model: nn.Module, **kw: Any) -> torch.Tensor:
        first = forward(fn, model, score_batch, packed=score_layout, **kw)
        rest = [first.new_empty(min(n, rows - i), *first.shape[1:]) for i in range(n, rows, n)]
        return torch.cat([first, *rest])

    def values_of(model: nn.Module, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
        return model(ids, **kw).float()

    logprobs = {"start": P0, "chunk_size": x.logits_chunk}
    with torch.no_grad():
        ref_logprobs = scored(token_logprobs, ref, **logprobs) if ref is not None else None
        values = None
        if critic is not None:
            values, _ = split_critic_values(scored(values_of, critic), mask)
        anchors = batch["rollout_logprobs"]
        for _ in range(x.correction.scoring_passes):
            anchors = scored(token_logprobs, actor, **logprobs)
    advantages = torch.zeros_like(mask)
    for i in range(0, micro_batches * mb_rows, mb_rows):
        mb = _rows(batch, i, mb_rows)
        if micro_mask is not None:
            mb = _batch(x.actor, mb_rows, S, x.response_len, device, micro_mask)
        m, sl = mb["response_mask"], slice(i, i + mb_rows)
        # the lm_head and the policy loss in one pass, as the recipe's actor micro-step
        spec = FusedLossSpec(
            anchor_logprobs=anchors[sl], advantages=advantages[sl], response_mask=m
        )
        loss = forward(fused_policy_loss, actor, mb, spec=spec, packed=mb_layout, **logprobs).loss
        loss.backward()
        del loss
        if critic is not None:
            v, _ = split_critic_values(forward(values_of, critic, mb, packed=mb_layout), m)
            vloss, _ = value_loss(v, values[sl], advantages[sl], m)
            vloss.backward()
            del v, vloss
    for opt in opts:  # clip_grad_norm_ left out (module docstring)
        bound = UpdateBound(1.0) if x.update_snapshot and opt is opts[0] else None
        if bound is not None:  # ppo.max_update_kl: the actor's copy before its step
            bound.snapshot(actor, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bound is not None:  # a step to shorten: the stepped weights kept, one re-score
            with torch.no_grad():
                stepped = [p.detach().clone() for p in actor.parameters()]
                forward(token_logprobs, actor, mb, packed=mb_layout, **logprobs)
            del bound, stepped
    del ref_logprobs


def measure_from_config(
    cfg: DictConfig,
    *,
    world_size: int = 1,
    device: str | None = None,
    fake: bool = True,
    **plan_kw: Any,
) -> MeasuredPeak:
    """:func:`measure_step` of a run config: the plan inputs of
    :func:`~minippo.plan.plan_inputs_from_config`, the configured optimizers and ``dtype``, the
    rank's batch (``rollout.groups_per_batch · rollout.samples_per_prompt / ranks`` rows) and its
    micro-batches per minibatch (``ppo.minibatches``, ``ppo.micro_batch_size``); ``fake``: see
    :func:`measure_step`."""
    x = plan_inputs_from_config(cfg, world_size=world_size, device=device, **plan_kw)
    groups = int(_select(cfg, "rollout.groups_per_batch"))
    rows = groups * int(_select(cfg, "rollout.samples_per_prompt")) // x.ranks
    if rows < 1:
        raise ConfigError(
            f"memory plan: rollout.groups_per_batch ({groups}) gives no rows to each of "
            f"{x.ranks} ranks; raise it to at least {x.ranks}"
        )
    per_minibatch = rows // int(_select(cfg, "ppo.minibatches"))
    return measure_step(
        x,
        compute_dtype=torch_dtype(_select(cfg, "dtype"), "dtype"),
        optimizer=_select(cfg, "optimizer"),
        critic_optimizer=OmegaConf.select(cfg, "critic.optimizer", default=None),
        batch_rows=rows,
        micro_batches=max(1, min(2, per_minibatch // x.micro_batch)),
        fake=fake,
    )
