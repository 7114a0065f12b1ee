"""Native model: shapes, masking, KV cache, chunked logprobs and entropy, value model, meta init."""

import math

import pytest
import torch

from minippo.models import (
    KVCache,
    ModelArgs,
    ScoreSpec,
    Transformer,
    ValueModel,
    init_weights,
    llama3_2_1b,
    qwen2_5_0_5b,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_tiny,
    token_logprobs,
    token_logprobs_and_entropy,
)
from minippo.models.logprobs import logprobs_from_hidden


def tiny_model(**overrides) -> Transformer:
    args = qwen3_tiny()
    for k, v in overrides.items():
        setattr(args, k, v)
    return init_weights(Transformer(args), seed=0)


def left_padded_batch(lengths: list[int], S: int, vocab: int, seed: int = 0):
    """Random tokens, LEFT padded: (tokens [B,S], attention_mask [B,S], position_ids [B,S])."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, S - n :] = True
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    tokens = tokens.masked_fill(~mask, 0)
    return tokens, mask, pos


def test_forward_shapes_and_tied_head():
    model = tiny_model()
    assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, 64, (3, 7))
    assert model(tokens).shape == (3, 7, 64)
    assert model(tokens, return_hidden=True).shape == (3, 7, 64)
    untied = init_weights(
        Transformer(ModelArgs(**{**qwen3_tiny().__dict__, "tie_word_embeddings": False}))
    )
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_causality_future_tokens_do_not_change_past_logits():
    model = tiny_model()
    a = torch.randint(0, 64, (2, 10))
    b = a.clone()
    b[:, 6:] = (b[:, 6:] + 1) % 64
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :6], lb[:, :6], rtol=0, atol=1e-6)
    assert (la[:, 6:] - lb[:, 6:]).abs().max() > 1e-3


def test_left_padding_matches_unpadded_rows():
    model = tiny_model()
    tokens, mask, pos = left_padded_batch([4, 7, 2], S=7, vocab=64)
    padded = model(tokens, attention_mask=mask, position_ids=pos)
    assert torch.isfinite(padded).all()  # padding queries still have a finite row
    for b, n in enumerate([4, 7, 2]):
        alone = model(tokens[b : b + 1, 7 - n :])
        torch.testing.assert_close(padded[b, 7 - n :], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["qwen3", "qwen2", "llama"])
def test_kv_cache_decode_equals_full_forward(variant):
    args = qwen3_tiny()
    if variant == "qwen2":
        args.qk_norm, args.qkv_bias, args.architecture = False, True, "Qwen2ForCausalLM"
    if variant == "llama":
        args.qk_norm, args.architecture = False, "LlamaForCausalLM"
        args.rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    model = init_weights(Transformer(args), seed=1)
    lengths, P, new = [3, 5, 1, 5], 5, 6
    prompt, pmask, ppos = left_padded_batch(lengths, S=P, vocab=64, seed=2)
    cont = torch.randint(0, 64, (4, new), generator=torch.Generator().manual_seed(3))
    full = torch.cat([prompt, cont], 1)
    full_mask = torch.cat([pmask, torch.ones(4, new, dtype=torch.bool)], 1)
    full_pos = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    ref = model(full, attention_mask=full_mask, position_ids=full_pos)

    cache = KVCache(args, batch_size=4, max_len=P + new)
    out = model(prompt, attention_mask=pmask, position_ids=ppos, kv_cache=cache)
    assert cache.length == P
    torch.testing.assert_close(out[pmask], ref[:, :P][pmask], rtol=0, atol=1e-5)
    rows = torch.arange(4)
    for t in range(new):
        if t == 3:  # drop rows 1 and 2 mid-decode
            keep = torch.tensor([0, 3])
            cache.keep(keep)
            rows = rows[keep]
        step = model(
            full[rows, P + t : P + t + 1],
            attention_mask=full_mask[rows, : P + t + 1],
            position_ids=full_pos[rows, P + t : P + t + 1],
            kv_cache=cache,
        )
        torch.testing.assert_close(step[:, 0], ref[rows, P + t], rtol=0, atol=1e-5)
    assert cache.length == P + new and cache.batch_size == 2
    with pytest.raises(ValueError, match="overflow"):
        model(
            full[rows, :1],
            attention_mask=full_mask[rows, :1].repeat(1, P + new + 1),
            kv_cache=cache,
        )


def _rmsnorm_formula(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_node_equals_autograd_of_its_formula(dtype):
    """RMSNorm is one autograd node with a hand-written backward: its forward is the formula's
    (bit for bit), its gradients are the formula's up to the rounding of ``dtype``."""
    from minippo.models.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    D = 64
    x = torch.randn(3, 5, D, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    upstream = torch.randn(3, 5, D, generator=g).to(dtype)
    norm = RMSNorm(D, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)

    def grads(fn, x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(x, w)
        y.backward(upstream.to(y.dtype))
        return y.detach(), x.grad, w.grad

    y, dx, dw = grads(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), x, w)
    y_ref, dx_ref, dw_ref = grads(lambda x, w: _rmsnorm_formula(x, w, 1e-6), x, w)
    assert torch.equal(y, y_ref)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    # float64 truth of the formula; either float path may be off by a few roundings of its dtype
    # per reduction over D terms (fp32: D·2^-24 relative; bf16: the output cast, 2^-8 relative)
    _, dx64, dw64 = grads(lambda x, w: _rmsnorm_formula(x, w, 1e-6), x.double(), w.double())
    unit = D * 2**-24 if dtype == torch.float32 else 4 * 2**-8
    for got, ref, truth in ((dx, dx_ref, dx64), (dw, dw_ref, dw64)):
        tol = unit * truth.abs().max().item()
        assert (got.double() - truth).abs().max().item() <= tol
        assert (ref.double() - truth).abs().max().item() <= tol
    # a frozen weight (the reference model): only the input gets a gradient
    xr = x.clone().requires_grad_()
    norm.weight.requires_grad_(False)
    norm(xr).backward(upstream)
    assert norm.weight.grad is None and torch.equal(xr.grad, dx)
    # no graph: the formula itself, the same bits
    with torch.no_grad():
        assert torch.equal(norm(x), y)
    # a graph of the backward (create_graph) would miss the saved tensors' dependence on x
    xr = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(norm(xr), xr, upstream, create_graph=True)


def test_token_logprobs_matches_naive_and_backprops():
    model = tiny_model()
    tokens, mask, pos = left_padded_batch([6, 9, 4], S=9, vocab=64)
    T, start = 0.7, 3

    def naive():
        logits = model(tokens, attention_mask=mask, position_ids=pos).float() / T
        lp = logits.log_softmax(-1)[:, start - 1 : -1]
        return lp.gather(-1, tokens[:, start:, None]).squeeze(-1)

    ref = naive()
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = token_logprobs(
        model,
        tokens,
        attention_mask=mask,
        position_ids=pos,
        temperature=T,
        start=start,
        chunk_size=5,
    )
    assert got.shape == (3, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    got.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(
            model, tokens, temperature=T, start=start, chunk_size=4
        )
        logits = model(tokens).float()[:, start - 1 : -1] / T
        p = logits.softmax(-1)
        torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=0, atol=1e-5)
        torch.testing.assert_close(
            lp,
            logits.log_softmax(-1).gather(-1, tokens[:, start:, None]).squeeze(-1),
            rtol=0,
            atol=1e-5,
        )


def test_token_logprobs_bad_input():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 5))
    with pytest.raises(ValueError, match="start"):
        token_logprobs(model, tokens, start=5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(model, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="kv_cache"):
        model(tokens, kv_cache=KVCache(model.args, 2, 8), score=ScoreSpec())
    with pytest.raises(ValueError, match="return_hidden"):
        model(tokens, return_hidden=True, score=ScoreSpec())
    # the scoring functions are model.forward with a ScoreSpec (so FSDP2 hooks see the work)
    spec = ScoreSpec(start=2, temperature=0.5, chunk_size=3, with_entropy=True)
    lp, ent = token_logprobs_and_entropy(model, tokens, temperature=0.5, start=2, chunk_size=3)
    via_forward = model(tokens, score=spec)
    assert torch.equal(lp, via_forward[0]) and torch.equal(ent, via_forward[1])


def test_entropy_by_hand():
    # lm_head = Linear(2, V) with chosen rows; hidden [1, 1, 2] picks the logits z = W h
    def scored(rows: list[list[float]], h: list[float], T: float = 1.0):
        head = torch.nn.Linear(2, len(rows), bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.tensor(rows))
        return logprobs_from_hidden(
            torch.tensor([[h]]), head, torch.tensor([[1]]), temperature=T, with_entropy=True
        )

    # uniform over 4: H = ln 4, log p = −ln 4
    lp, ent = scored([[0.0, 0.0]] * 4, [1.0, 0.0])
    assert ent.item() == pytest.approx(math.log(4)) and lp.item() == pytest.approx(-math.log(4))
    # z = (0, ln 3): p = (1/4, 3/4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    lp, ent = scored([[0.0, 0.0], [math.log(3), 0.0]], [1.0, 0.0])
    assert ent.item() == pytest.approx(h) and lp.item() == pytest.approx(math.log(0.75))
    # temperature 2 on z = (0, 2 ln 3) is the same distribution
    lp, ent = scored([[0.0, 0.0], [math.log(3), 0.0]], [2.0, 0.0], T=2.0)
    assert ent.item() == pytest.approx(h) and lp.item() == pytest.approx(math.log(0.75))
    # a near point mass (p_0 = e^-200 underflows in float32): entropy 0, no nan
    lp, ent = scored([[0.0, 0.0], [200.0, 0.0]], [1.0, 0.0])
    assert ent.item() == 0.0 and lp.item() == 0.0


def test_chunked_logprobs_and_entropy_match_one_chunk_values_and_grads():
    # Chunking only splits the rows of the [B·L, D] hidden states; each row's logits, logsumexp
    # and entropy are the same float32 arithmetic in every split, so values and gradients agree up
    # to the rounding of the float64 → float32 cast of the logits (one ulp of z, u·|z| with
    # u = 2⁻²⁴) carried through O(V) float32 terms: bound (V + 8)·u·Σ|term| per element.
    g = torch.Generator().manual_seed(0)
    B, L, D, V, T = 2, 7, 5, 11, 0.7
    hidden = torch.randn(B, L, D, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(D, V, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g, dtype=torch.float64))
    targets = torch.randint(0, V, (B, L), generator=g)
    u = 2.0**-24

    def run(chunk_size: int):
        lp, ent = logprobs_from_hidden(
            hidden,
            head,
            targets,
            temperature=T,
            chunk_size=chunk_size,
            with_entropy=True,
            entropy_grad=True,
        )
        grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, head.weight))
        return lp, ent, grads

    lp1, ent1, grads1 = run(B * L)
    lp3, ent3, grads3 = run(3)
    z = (hidden.detach() @ head.weight.detach().t()) / T  # [B, L, V]
    p = z.softmax(-1)
    # H = −Σ p log p from the float64 logits; log p of the targets
    ent_ref = -(p * p.log()).sum(-1)
    lp_ref = z.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    # |lse| + Σ_v p_v |z_v| bounds the magnitude of the terms of lp and H
    scale = z.logsumexp(-1).abs() + (p * z.abs()).sum(-1)
    bound = (V + 8) * u * scale
    for got in (lp1, lp3):
        assert got.dtype == torch.float32
        assert ((got.double() - lp_ref).abs() <= bound).all()
    for got in (ent1, ent3):
        assert ((got.double() - ent_ref).abs() <= bound).all()
    assert ((lp3 - lp1).abs() <= bound).all() and ((ent3 - ent1).abs() <= bound).all()
    # d(lp + H)/dz_v has magnitude ≤ (1 + |z|max)·(p_v + 1[v = t]) ≤ 2(1 + |z|max) per row; the
    # gradients are its float32 rounding times W (hidden) or h (weight), summed over V or B·L rows
    zmax = float(z.abs().max())
    w_abs = head.weight.detach().abs()
    h_abs = hidden.detach().abs()
    bound_h = (V + 8) * u * 2 * (1 + zmax) / T * w_abs.sum(0)  # [D]
    bound_w = (V + 8) * u * 2 * (1 + zmax) / T * h_abs.reshape(-1, D).sum(0)  # [D]
    assert ((grads3[0] - grads1[0]).abs() <= bound_h).all()
    assert ((grads3[1] - grads1[1]).abs() <= bound_w).all()


def test_value_model_shapes_and_zero_head():
    critic = init_weights(ValueModel(qwen3_tiny()), seed=0)
    tokens, mask, pos = left_padded_batch([3, 5], S=5, vocab=64)
    v = critic(tokens, attention_mask=mask, position_ids=pos)
    assert v.shape == (2, 5)
    assert torch.equal(v, torch.zeros(2, 5))  # head starts at 0
    assert not hasattr(critic, "output")


def test_meta_init_then_materialise_equals_direct_init():
    args = qwen3_tiny()
    with torch.device("meta"):
        meta = Transformer(args)
    assert meta.output.weight is meta.tok_embeddings.weight
    meta.to_empty(device="cpu")
    init_weights(meta, seed=5)
    direct = init_weights(Transformer(args), seed=5)
    assert meta.output.weight is meta.tok_embeddings.weight
    tokens = torch.randint(0, 64, (2, 6))
    assert torch.equal(meta(tokens), direct(tokens))


def test_builders_parameter_counts():
    def count(args):
        with torch.device("meta"):
            return sum(p.numel() for p in Transformer(args).parameters())

    # published sizes (tied embeddings counted once)
    assert abs(count(qwen3_0_6b()) / 1e9 - 0.596) < 0.01
    assert abs(count(qwen3_1_7b()) / 1e9 - 1.72) < 0.02
    assert abs(count(qwen3_4b()) / 1e9 - 4.02) < 0.03
    assert abs(count(qwen3_8b()) / 1e9 - 8.19) < 0.03
    assert abs(count(qwen2_5_0_5b()) / 1e9 - 0.494) < 0.01
    assert abs(count(llama3_2_1b()) / 1e9 - 1.236) < 0.01


def test_model_args_validation():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(vocab_size=8, dim=16, n_layers=1, n_heads=4, n_kv_heads=3, intermediate_size=8)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        ModelArgs(
            vocab_size=8,
            dim=16,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            intermediate_size=8,
            architecture="Gpt2",
        )


def test_logged_entropy_adds_no_backward_memory():
    """The training forward computes entropies for logging only; their per-chunk softmax must not
    be recomputed and kept alive by backward (it was: one [chunk, V] float32 buffer per chunk)."""
    from benchmarks._common import TensorMemoryTracker

    torch.manual_seed(0)
    B, L, D, V, chunk = 2, 64, 16, 4096, 32  # 4 chunks, each softmax 32 x 4096 x 4 B = 0.5 MiB
    head = torch.nn.Linear(D, V, bias=False)
    targets = torch.randint(0, V, (B, L))

    def backward_peak(with_entropy: bool) -> int:
        hidden = torch.randn(B, L, D, requires_grad=True)
        tracker = TensorMemoryTracker().track(head, hidden)
        with tracker:
            out = logprobs_from_hidden(
                hidden, head, targets, chunk_size=chunk, with_entropy=with_entropy
            )
            lp = out[0] if with_entropy else out
            lp.sum().backward()
        return tracker.peak["cpu"]

    one_chunk_logits = chunk * V * 4
    # the same backward, up to one chunk's logits (the entropy's own forward before backward)
    assert backward_peak(True) <= backward_peak(False) + one_chunk_logits
