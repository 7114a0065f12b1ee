"""keep_old_actor and ewma on an FSDP2-sharded actor, 2 gloo processes on CPU.

Every rank holds its own batch; the snapshots and θ̄ hold local shards only. Anchors must equal,
bit for bit, those of an unsharded model loaded with the full weights of each token's version,
including ranks whose batches hold different versions (every rank must run the same forwards).
Why bit for bit holds on any CPU: both sides run the same scorer (``response_logprobs`` or
``logits_score``, padded) on the same batch in the same process and thread count, and FSDP2's
forward computes on the all-gathered fp32 weights, a copy of the full ones: the same kernels on
the same shapes in the same order.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import distribute_tensor

from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.parallel import shard_model
from minippo.parallel.weight_swap import local_shards
from minippo.rl.correction import EWMA, KeepOldActor
from minippo.rl.types import RolloutBatch
from tests.correction_helpers import model_with, perturb, score

WORLD_SIZE = 2
P, R, V = 3, 4, 64


def logits_score(model, batch: RolloutBatch) -> torch.Tensor:
    """log_softmax(logits)[next token] of the response positions from one full forward."""
    logits = model(
        batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
    )
    lp = torch.log_softmax(logits[:, P - 1 : -1].float(), dim=-1)
    return lp.gather(-1, batch.input_ids[:, P:, None]).squeeze(-1)


def make_batch(versions, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(versions, dtype=torch.int64)
    B = v.shape[0]
    resp = (v >= 0).float()
    attn = torch.cat([torch.ones(B, P, dtype=torch.bool), resp.bool()], dim=1)
    pos = (attn.long().cumsum(1) - 1).clamp(min=0) * attn.long()
    ids = torch.randint(1, V, (B, P + R), generator=g) * attn.long()
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        response_mask=resp,
        rollout_logprobs=torch.where(resp > 0, -torch.rand(B, R, generator=g) - 1.0, 0.0),
        versions=v,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )


def reshard(model):
    # after a no-grad forward FSDP2 keeps the root's parameters unsharded; shard them again
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_into_sharded(sharded, full_model):
    """Copy the full weights of ``full_model`` into the local shards of ``sharded``."""
    reshard(sharded)
    with torch.no_grad():
        for p, q in zip(sharded.parameters(), full_model.parameters()):
            local = distribute_tensor(q.detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())


def _worker(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _check_keep_old_actor(rank)
        _check_ewma(rank)
    finally:
        dist.destroy_process_group()


def _sharded_pair():
    ref = init_weights(Transformer(qwen3_tiny(V)), seed=0, std=0.5)  # unsharded full weights
    actor = init_weights(Transformer(qwen3_tiny(V)), seed=0, std=0.5)
    shard_model(actor)  # fully_shard per block, then the root
    assert all(type(p).__name__ == "DTensor" for p in actor.parameters())
    return ref, actor


def _check_keep_old_actor(rank: int) -> None:
    ref, actor = _sharded_pair()
    corr = KeepOldActor(max_staleness=2)  # default scorer: token_logprobs (Transformer.score)
    saved = []
    for v in range(3):
        saved.append([p.detach().clone() for p in ref.parameters()])
        corr.on_weights_published(v, actor)
        perturb(ref, seed=10 + v)
        load_into_sharded(actor, ref)
    # snapshots hold local shards only: this rank's bytes are about half of the model's
    local_bytes = sum(t.numel() * t.element_size() for t in local_shards(actor))
    full_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert corr.snapshot_bytes == 3 * local_bytes < 3 * full_bytes * 0.75
    # rank 0 holds versions {0, 1} (one response spans them), rank 1 holds {1, 2}
    versions = [[0, 0, 1, 1], [1, 1, 1, -1]] if rank == 0 else [[1, 2, 2, 2], [2, 2, -1, -1]]
    batch = make_batch(versions, seed=rank)
    calls = []
    actor.tok_embeddings.register_forward_hook(lambda *a: calls.append(1))
    out = corr.prepare(batch, actor, step=2)
    assert len(calls) == 3, calls  # the union of versions over ranks, on every rank
    assert out.metrics()["correction/version_mismatches"] == 0
    refs = [score(model_with(w), batch) for w in saved]
    expected = torch.zeros(batch.versions.shape)
    for v, lp in enumerate(refs):
        expected = torch.where(batch.versions == v, lp, expected)
    assert torch.equal(out.anchor_logprobs, expected), (out.anchor_logprobs - expected).abs().max()
    # the actor holds its current (unpublished) weights again
    reshard(actor)
    for p, q in zip(actor.parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.detach())


def _check_ewma(rank: int) -> None:
    ref, actor = _sharded_pair()
    corr = EWMA(max_staleness=1, updates_per_step=2, score_fn=logits_score)  # β = 1/2
    ref_corr = EWMA(max_staleness=1, updates_per_step=2, score_fn=logits_score)
    corr.on_weights_published(0, actor)
    ref_corr.on_weights_published(0, ref)
    for k in range(3):
        perturb(ref, seed=50 + k, scale=0.02)
        load_into_sharded(actor, ref)
        corr.after_optimizer_step(actor)
        ref_corr.after_optimizer_step(ref)
    # θ̄ shards are the local pieces of the unsharded θ̄
    for tb, rtb, p in zip(corr.theta_bar, ref_corr.theta_bar, actor.parameters()):
        local = distribute_tensor(rtb, p.device_mesh, p.placements, src_data_rank=None).to_local()
        assert torch.equal(tb, local)
    d, d_ref = corr.distance(actor), ref_corr.distance(ref)
    assert d > 0 and abs(d - d_ref) <= 1e-5 * d_ref
    batch = make_batch([[1, 1, 1, 1], [0, 1, 1, -1]], seed=10 + rank)
    ref_anchor = logits_score(model_with(ref_corr.theta_bar), batch).detach()
    # rank 0's engine logprobs agree with θ̄ (all kept), rank 1's are far off (all masked):
    # globally 4 of 7 + 7 tokens... retained 7/14 = 0.5 < 0.8, so BOTH ranks reset together
    batch.rollout_logprobs = torch.where(
        batch.response_mask > 0, ref_anchor + (0.0 if rank == 0 else 5.0), 0.0
    )
    out = corr.prepare(batch, actor, step=1)
    assert out.metrics()["correction/ewma_retained_before_reset"] == 0.5
    reshard(actor)
    assert out.metrics()["correction/ewma_resets"] == 1
    for tb, p in zip(corr.theta_bar, actor.parameters()):
        assert torch.equal(tb, p.to_local())
    current = logits_score(ref, batch).detach() * batch.response_mask
    assert torch.equal(out.anchor_logprobs, current)


def test_keep_old_actor_and_ewma_under_fsdp2(run_on_ranks):
    run_on_ranks(_worker, world_size=WORLD_SIZE)
