"""TrainerOffload under FSDP2 on 2 gloo ranks, with the actor and the critic sharded as the recipe
shards them: an offload/reload round trip (also from the unsharded state a no-grad forward leaves)
keeps every local shard, gradient and optimizer state (torch AdamW, torchao AdamW8bit) bit-identical
and the Parameter objects the same, the storage leaves while offloaded, and training continues
exactly as without the round trips."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from minippo.models import Transformer, ValueModel, init_weights, qwen3_tiny
from minippo.parallel import (
    TrainerOffload,
    destroy_distributed,
    gather_full_state_dict,
    init_distributed,
    shard_model,
)
from minippo.training.optimizers import build_optimizer
from tests.unit.test_offload import (
    assert_released,
    assert_same,
    data_ptrs,
    snapshot,
    storage_refs,
)


def _build():
    """[(actor, torch AdamW), (critic, torchao AdamW8bit)], sharded; the actor computes in bf16
    as the recipe's does; the critic keeps its parameters unsharded after a forward, and its head
    [1, 64] leaves rank 1 an empty shard (FSDP2 pads it)."""
    args = qwen3_tiny()
    actor = init_weights(Transformer(args), seed=0)
    shard_model(actor, param_dtype=torch.bfloat16, sum_gradients=True)
    critic = init_weights(ValueModel(args), seed=1)
    with torch.no_grad():  # a non-zero head, so that every critic parameter gets a gradient
        critic.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    shard_model(critic, sum_gradients=True, reshard_after_forward=False)
    pairs = []
    for model, comp in (
        (actor, "minippo.training.optimizers.AdamW"),
        (critic, "torchao.optim.AdamW8bit"),
    ):
        node = OmegaConf.create({"_component_": comp, "lr": 1e-2})
        pairs.append((model, build_optimizer(node, model.parameters())))
    return pairs


def _backward(pairs, rank: int, i: int) -> None:
    """Each rank its own rows: the actor's token loss and the critic's value regression."""
    g = torch.Generator().manual_seed(100 * i + rank)
    tokens = torch.randint(0, 64, (2, 13), generator=g)
    (actor, _), (critic, _) = pairs
    logits = actor(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    values = critic(tokens)
    F.mse_loss(values, torch.randn(values.shape, generator=g)).backward()


def _step(pairs, rank: int, i: int) -> None:
    _backward(pairs, rank, i)
    for _, opt in pairs:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _snap(pairs):
    return [snapshot(m, o) for m, o in pairs]


def _check_round_trip(rank):
    pairs = _build()
    for i in range(2):
        _step(pairs, rank, i)
    _backward(pairs, rank, 2)  # gradients present: they move too
    (actor, _), (critic, _) = pairs
    params = [list(m.parameters()) for m, _ in pairs]
    before = _snap(pairs)
    ptrs = [data_ptrs(m, o) for m, o in pairs]
    refs = [storage_refs(m, o) for m, o in pairs]
    assert any(k.startswith("DTensor[OptimState8bit") for k, _ in before[1].values())
    assert any(name.endswith(".grad") for name in before[0])
    assert critic.value_head.weight.to_local().numel() == (64 if rank == 0 else 0)

    with torch.no_grad():  # the critic's parameters stay unsharded: offload must reshard first
        critic(torch.zeros(1, 4, dtype=torch.long))
    assert not isinstance(critic.layers[0].attention.wq.weight, DTensor)
    offload = TrainerOffload(pairs)
    offload.offload()
    for (model, opt), old in zip(pairs, ptrs, strict=True):
        moved = data_ptrs(model, opt)
        for name, a in old.items():
            assert all(x != y for x, y in zip(a, moved[name], strict=True)), name
    for r in refs:
        assert_released(r)
    assert all(isinstance(p, DTensor) for m, _ in pairs for p in m.parameters())
    for snap, ref in zip(_snap(pairs), before, strict=True):
        assert_same(snap, ref)

    offload.reload()
    for (model, _), ps in zip(pairs, params, strict=True):
        assert all(a is b for a, b in zip(model.parameters(), ps, strict=True))
    assert actor.output.weight is actor.tok_embeddings.weight
    for snap, ref in zip(_snap(pairs), before, strict=True):
        assert_same(snap, ref)
    # the sharded modules still train: a step with the gradients that went to the host and back
    for _, opt in pairs:
        opt.step()
        opt.zero_grad(set_to_none=True)
    _step(pairs, rank, 3)


def _check_continuation(rank):
    pairs, twins = _build(), _build()
    offload = TrainerOffload(pairs)
    for i in range(3):
        offload.offload()  # the first one before any optimizer state exists
        offload.reload()
        _step(pairs, rank, i)
        _step(twins, rank, i)
    for snap, ref in zip(_snap(pairs), _snap(twins), strict=True):
        assert_same(snap, ref)
    for (model, _), (twin, _) in zip(pairs, twins, strict=True):
        full, full_twin = gather_full_state_dict(model), gather_full_state_dict(twin)
        assert all(torch.equal(full[k], full_twin[k]) for k in full_twin)


def _worker(rank, world):
    init_distributed()
    try:
        with torch.compiler.set_stance("force_eager"):  # torchao compiles its step otherwise
            _check_round_trip(rank)
            _check_continuation(rank)
    finally:
        destroy_distributed()


@pytest.mark.slow  # ~45 s; the single-process round trip and the recipe run test it by default
def test_offload_fsdp_round_trip_and_exact_continuation(run_on_ranks):
    run_on_ranks(_worker)
