"""FSDP2 on 2 gloo ranks: meta init + full load, sharded forward/backward (through the chunked
token_logprobs) equal to the unsharded model, gathering, buckets, a train step, HF export."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minippo.models import (
    Transformer,
    ValueModel,
    from_pretrained,
    hf_name,
    init_weights,
    qwen3_tiny,
    save_pretrained_state_dict,
    token_logprobs,
)
from minippo.parallel import (
    destroy_distributed,
    full_tensor_buckets,
    gather_full_state_dict,
    init_distributed,
    load_full_state_dict,
    shard_model,
)


def _batch():
    """4 left-padded rows (identical on every rank): tokens, mask, positions."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (4, 10), generator=g)
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, :5] = False
    return tokens, mask, (mask.long().cumsum(-1) - 1).clamp(min=0)


def _loss(model, tokens, mask, pos, scale):
    # logprob loss over the "response" (positions 4..9); scale makes the DP mean the full mean
    lp = token_logprobs(
        model, tokens, attention_mask=mask, position_ids=pos, temperature=0.8, start=4, chunk_size=5
    )
    return -lp.sum() * scale


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _check_tied(rank, world, tie, tmpdir):
    args = replace(qwen3_tiny(), tie_word_embeddings=tie)
    ref = init_weights(Transformer(args), seed=0)
    full_sd = {k: v.clone() for k, v in ref.state_dict().items()}

    with torch.device("meta"):
        model = Transformer(args)
    shard_model(model)
    load_full_state_dict(
        model, full_sd if rank == 0 else None, device="cpu", broadcast_from_rank0=True
    )
    assert isinstance(model.layers[0].attention.wq.weight, DTensor)
    assert (model.output.weight is model.tok_embeddings.weight) == tie

    # gathered full state dict == unsharded, bit for bit
    gathered = gather_full_state_dict(model)
    assert gathered.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert torch.equal(gathered[name], p.detach()), name

    # forward/backward: each rank holds 2 of the 4 rows
    tokens, mask, pos = _batch()
    rows = slice(2 * rank, 2 * rank + 2)
    n = 4 * 6
    with torch.no_grad():
        d_logits = _max_diff(
            model(tokens[rows], attention_mask=mask[rows], position_ids=pos[rows]),
            ref(tokens[rows], attention_mask=mask[rows], position_ids=pos[rows]),
        )
    assert d_logits <= 1e-5, d_logits
    _loss(ref, tokens, mask, pos, 1 / n).backward()
    _loss(model, tokens[rows], mask[rows], pos[rows], world / n).backward()
    # Gradients. Every entry is a float32 sum over the N = B·S positions of the batch; giving each
    # rank 2 of the 4 rows only changes the order of those sums and adds one reduce-scatter add
    # (the two loss scales differ by the factor world = 2, which FSDP divides out: exact). A sum of
    # N terms whose partial sums stay within the tensor's gradient scale G = max|g| rounds by at
    # most (N − 1)·u·G, so the two evaluations differ by at most 2N·u·G per tensor, whatever
    # order a CPU's kernels sum in (observed: ≤ 6·u·G).
    u = torch.finfo(torch.float32).eps / 2  # unit roundoff, 2⁻²⁴
    N = tokens.numel()
    grads = {}
    d_grad = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, name
        g = p.grad.full_tensor()
        d = _max_diff(g, q.grad)
        assert d <= 2 * N * u * q.grad.abs().max().item(), (name, d)
        d_grad = max(d_grad, d)
        grads[name] = (g, q.grad.clone(), q.detach().clone())

    # one AdamW step on both
    lr, eps = 1e-2, 1e-8
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=lr, eps=eps, weight_decay=0.1)
        opt.step()
        opt.zero_grad()
    gathered = gather_full_state_dict(model)
    # AdamW's first step is p ← p·(1 − lr·wd) − lr·f(g) with f(g) = g / (|g| + eps) (m̂ = g,
    # √v̂ = |g|): the decay is the same on both sides (p is equal), and f'(g) = eps / (|g| + eps)²,
    # so a gradient difference Δg moves the weight by at most lr·Δg·eps / (m + eps)², m the
    # smallest |g| between the two gradients (0 if their signs differ). Near |g| ≈ eps this
    # amplifies Δg by up to 1/eps = 1e8: a gradient of 1e-9 that differs by 1e-16 in the last bits
    # moves the weight by lr·1e-8. On top, each side rounds the step (≤ 8 roundings of a term
    # ≤ lr) and the new weight (u·(|p| + lr)): u·(2|p| + 18·lr) for both together.
    d_step = 0.0
    for name, (g, g_ref, p0) in grads.items():
        m = torch.where(g * g_ref > 0, torch.minimum(g.abs(), g_ref.abs()), torch.zeros_like(g))
        bound = lr * (g - g_ref).abs() * eps / (m + eps) ** 2 + u * (2 * p0.abs() + 18 * lr)
        diff = (gathered[name] - dict(ref.named_parameters())[name].detach()).abs()
        assert (diff <= bound).all(), (name, diff.max().item(), (diff / bound).max().item())
        d_step = max(d_step, diff.max().item())

    # buckets: HF names, bounded sizes, same order on both ranks, tied lm_head skipped
    buckets = list(full_tensor_buckets(model, bucket_bytes=20_000, dtype=torch.bfloat16))
    names = [name for b in buckets for name, _ in b]
    assert len(buckets) > 1
    assert ("lm_head.weight" in names) == (not tie)
    assert names == [hf_name(k) for k in gathered]
    for b in buckets:
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 20_000
        assert all(t.dtype == torch.bfloat16 for _, t in b)
    flat = dict(x for b in buckets for x in b)
    for k, v in gathered.items():
        assert torch.equal(flat[hf_name(k)], v.to(torch.bfloat16)), k
    all_names = [None] * world
    dist.all_gather_object(all_names, names)
    assert all(x == names for x in all_names)

    # export from the gathered tensors, reload, same logits as the sharded model
    out = f"{tmpdir}/export_tie{int(tie)}"
    only0 = gather_full_state_dict(model, rank0_only=True)
    assert (only0 == {}) == (rank != 0)
    if rank == 0:
        save_pretrained_state_dict(only0, args, out)
    dist.barrier()
    reloaded = from_pretrained(out)
    with torch.no_grad():
        d_export = _max_diff(
            reloaded(tokens, attention_mask=mask, position_ids=pos),
            model(tokens, attention_mask=mask, position_ids=pos),
        )
    assert d_export <= 1e-6, d_export
    return d_logits, d_grad, d_step, d_export


def _check_value_model_and_mixed_precision(rank, world):
    args = qwen3_tiny()
    ref = init_weights(ValueModel(args), seed=1)
    with torch.no_grad():
        ref.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        critic = ValueModel(args)
    shard_model(critic)
    load_full_state_dict(critic, sd, device="cpu")
    tokens, mask, pos = _batch()
    with torch.no_grad():
        d = _max_diff(
            critic(tokens, attention_mask=mask, position_ids=pos),
            ref(tokens, attention_mask=mask, position_ids=pos),
        )
    assert d <= 1e-5, d

    # random init of a meta-built sharded critic equals the unsharded init
    with torch.device("meta"):
        fresh = ValueModel(args)
    shard_model(fresh)
    fresh.to_empty(device="cpu")
    init_weights(fresh, seed=1)
    full = gather_full_state_dict(fresh)
    plain = init_weights(ValueModel(args), seed=1)
    for k, p in plain.named_parameters():
        assert torch.equal(full[k], p.detach()), k

    # bf16 compute, fp32 master weights: close to fp32 logits, masters untouched
    actor_ref = init_weights(Transformer(args), seed=2)
    with torch.device("meta"):
        actor = Transformer(args)
    shard_model(actor, param_dtype=torch.bfloat16)
    load_full_state_dict(actor, actor_ref.state_dict(), device="cpu")
    with torch.no_grad():
        logits = actor(tokens)
        assert logits.dtype == torch.bfloat16
        assert _max_diff(logits.float(), actor_ref(tokens)) < 5e-2
    full = gather_full_state_dict(actor)
    assert full["layers.0.attention.wq.weight"].dtype == torch.float32
    assert torch.equal(
        full["layers.0.attention.wq.weight"], actor_ref.layers[0].attention.wq.weight
    )


def _worker(rank, world, tmpdir):
    info = init_distributed()
    assert (info.rank, info.world_size, info.device.type, info.distributed) == (
        rank,
        world,
        "cpu",
        True,
    )
    try:
        for tie in (True, False):
            figures = _check_tied(rank, world, tie, tmpdir)
            if rank == 0:
                print(
                    f"tie={tie}: logits {figures[0]:.1e} grads {figures[1]:.1e} "
                    f"after AdamW {figures[2]:.1e} export {figures[3]:.1e}"
                )
        _check_value_model_and_mixed_precision(rank, world)
    finally:
        destroy_distributed()


def test_fsdp_sharded_equals_unsharded_and_exports(run_on_ranks, tmp_path):
    run_on_ranks(_worker, str(tmp_path))


def test_init_distributed_single_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = init_distributed()
    assert (info.rank, info.world_size, info.local_rank, info.distributed) == (0, 1, 0, False)
    assert not dist.is_initialized()
    # plain modules need no process group for buckets
    model = init_weights(Transformer(qwen3_tiny()), seed=0)
    buckets = list(full_tensor_buckets(model, bucket_bytes=1))
    assert all(len(b) == 1 for b in buckets)
    names = [b[0][0] for b in buckets]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names


def test_load_full_state_dict_plain_module_and_errors(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    src = init_weights(Transformer(qwen3_tiny()), seed=3)
    sd = {k: v for k, v in src.state_dict().items() if k != "output.weight"}  # tied head optional
    with torch.device("meta"):
        model = Transformer(qwen3_tiny())
    load_full_state_dict(model, sd, device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, 64, (2, 5))
    assert torch.equal(model(tokens), src(tokens))
    with torch.device("meta"):
        model = Transformer(qwen3_tiny())
    bad = dict(sd)
    bad.pop("norm.weight")
    bad["layers.9.ffn_norm.weight"] = torch.ones(64)
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\].*layers\.9\.ffn_norm"):
        load_full_state_dict(model, bad, device="cpu")
    with pytest.raises(RuntimeError, match="init_distributed"):
        shard_model(Transformer(qwen3_tiny()))
