"""TorchEngine: the shared protocol suite plus exact checks against the trainer's model.

Measured here (printed with -s): max |engine logprob - teacher-forced trainer logprob| in fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

from minippo.config import instantiate
from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine._cpu_kernels import onednn_linear_available, pack_linears
from minippo.engine.sampling import (
    block_sums,
    filter_top_k_top_p,
    inverse_cdf,
    request_uniforms,
    sample_next,
    sample_unfiltered,
)
from minippo.engine.torch_engine import TorchEngine
from minippo.models import Transformer, hf_name, init_weights, qwen3_tiny, token_logprobs
from minippo.training.rollout_queue import collate_completions
from tests.engine_suite import (
    EngineHarness,
    EngineProtocolSuite,
    one_torch_thread,  # noqa: F401 (autouse: one torch thread for this module)
    publish_model,
    reference_logprobs_of,
    req,
)

ARGS = qwen3_tiny()


_MODELS: dict[int, Transformer] = {}


def model_of(version: int) -> Transformer:
    """The trainer-side model holding the weights of ``version`` (distinct random weights)."""
    if version not in _MODELS:
        _MODELS[version] = init_weights(Transformer(ARGS), seed=1000 + version, std=0.1).eval()
    return _MODELS[version]


def weights(version: int):
    # HF names, as the trainer sends them (the tied lm_head is not sent)
    items = [(hf_name(n), p.detach()) for n, p in model_of(version).named_parameters()]
    return [items[: len(items) // 2], items[len(items) // 2 :]]  # two buckets


reference_logprobs = reference_logprobs_of(model_of)


def harness_for(in_process: bool) -> EngineHarness:
    return EngineHarness(
        make_engine=lambda: publish_model(TorchEngine(ARGS, in_process=in_process), model_of(0)),
        vocab_size=ARGS.vocab_size,
        max_seq_len=ARGS.max_seq_len,
        weights=weights,
        reference_logprobs=reference_logprobs,
        long_tokens=ARGS.max_seq_len - 8,
        mu_draws=4000,
    )


class TestTorchEngineProtocol(EngineProtocolSuite):
    @pytest.fixture
    def harness(self):
        return harness_for(in_process=True)


@pytest.fixture
def engine():
    eng = publish_model(TorchEngine(ARGS, in_process=True), model_of(0))
    yield eng
    eng.shutdown()


@torch.no_grad()
def test_logprobs_equal_teacher_forced_trainer_forward(engine):
    """Mixed prompt lengths (left padding), mixed lengths (compaction), every sampling option."""
    opts = [
        dict(temperature=1.0),
        dict(temperature=0.6, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=20, top_p=0.95, stop_token_ids=(3, 9)),
    ]
    reqs = [
        GenerateRequest(
            [1 + (7 * i + j) % 60 for j in range(1 + 3 * i)],
            SamplingParams(max_new_tokens=10 + 5 * i, seed=i, **o),
            f"r{i}",
        )
        for i, o in enumerate(opts)
    ]
    outs = engine.generate(reqs)
    worst = 0.0
    for c, r in zip(outs, reqs):  # one sequence at a time, no padding
        ref = reference_logprobs(0, r.prompt_ids, c.token_ids, r.params.temperature)
        worst = max(worst, *(abs(a - b) for a, b in zip(c.logprobs, ref)))
    # the batched layout the trainer uses (RolloutBatch), per temperature
    batch = collate_completions(outs, list(range(len(outs))))
    for i, r in enumerate(reqs):
        lp = token_logprobs(
            model_of(0),
            batch.input_ids[i : i + 1],
            attention_mask=batch.attention_mask[i : i + 1],
            position_ids=batch.position_ids[i : i + 1],
            temperature=r.params.temperature or 1.0,
            start=batch.prompt_len,
        )
        m = batch.response_mask[i].bool()
        worst = max(worst, float((lp[0][m] - batch.rollout_logprobs[i][m]).abs().max()))
    print(f"\nmax |engine - trainer| logprob (fp32): {worst:.3g}")
    assert worst <= 1e-4


def test_response_spanning_a_publish_has_both_versions_at_the_right_positions(engine):
    prompt = [5, 6, 7]
    r = GenerateRequest(prompt, SamplingParams(max_new_tokens=400, seed=11), "span")
    result = {}
    import threading

    t = threading.Thread(target=lambda: result.update(c=engine.generate([r])[0]))
    t.start()
    deadline = time.time() + 60
    while engine.stats()["decode_steps"] < 5:  # one token per decode step
        assert time.time() < deadline
        time.sleep(0.001)
    engine.pause()
    n_old = engine.stats()["decode_steps"]
    time.sleep(0.05)
    assert engine.stats()["decode_steps"] == n_old  # paused: no progress
    engine.publish_weights(weights(1), version=1)
    engine.resume()
    t.join(60)
    c = result["c"]
    assert 5 <= n_old < 400 and len(c.token_ids) == 400
    assert c.versions == [0] * n_old + [1] * (400 - n_old)
    old = reference_logprobs(0, prompt, c.token_ids, 1.0)
    new = reference_logprobs(1, prompt, c.token_ids, 1.0)
    err_old = max(abs(a - b) for a, b in zip(c.logprobs[:n_old], old[:n_old]))
    err_new = max(abs(a - b) for a, b in zip(c.logprobs[n_old:], new[n_old:]))
    assert err_old <= 1e-4 and err_new <= 1e-4, (err_old, err_new)
    # the two weight sets really differ on these tokens
    assert max(abs(a - b) for a, b in zip(old[n_old:], new[n_old:])) > 1e-2
    assert engine.stats()["reprefills"] == 1


def test_publish_accepts_native_names_and_refuses_unknown_or_misshaped(engine):
    """A publish returns before the engine applies it; a failed one raises in the next call (once)
    and the engine refuses to generate until a publish succeeds."""
    sd = model_of(1).state_dict()
    engine.publish_weights([[("norm.weight", sd["norm.weight"])]], version=1)
    engine.wait_published()
    req = GenerateRequest([1], SamplingParams(max_new_tokens=2), "ok")
    engine.publish_weights([[("model.not_a_weight", torch.zeros(1))]], version=2)
    with pytest.raises(RuntimeError, match="not_a_weight"):
        engine.wait_published()
    with pytest.raises(RuntimeError, match=r"publish of version 2 failed.*publish again"):
        engine.generate([req])
    engine.publish_weights([[("model.norm.weight", torch.zeros(3))]], version=2)
    with pytest.raises(RuntimeError, match="shape"):  # the next publish raises the failed one's
        engine.publish_weights(weights(2), version=2)
    assert engine.version == 2  # what the failed publish stamped; the weights are not version 2
    engine.publish_weights(weights(2), version=2)
    (c,) = engine.generate([req])
    assert c.finish_reason == "length" and c.versions == [2, 2]  # serving again


def test_failed_publish_fails_the_running_calls(engine):
    """The calls in the engine when a publish fails (they would go on under partly updated
    weights) end with the publish's error; the next control call raises it too."""
    import threading

    long = GenerateRequest([1, 2], SamplingParams(max_new_tokens=40, seed=0), "long")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            engine.generate([long])
        except RuntimeError as e:
            errors.append(e)

    engine.pause()  # the request is in the engine, not yet decoding
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    engine.publish_weights([[("model.norm.weight", torch.zeros(3))]], version=1)
    with pytest.raises(RuntimeError, match="shape"):
        engine.resume()
    engine.resume()
    t.join(timeout=60)
    assert not t.is_alive() and len(errors) == 1
    assert "publish of version 1 failed" in str(errors[0])


def test_abort_mid_generation_keeps_the_tokens_so_far(engine):
    import threading

    r = GenerateRequest([1, 2], SamplingParams(max_new_tokens=500, seed=0), "a")
    out = {}
    t = threading.Thread(target=lambda: out.update(c=engine.generate([r])[0]))
    t.start()
    while engine.stats()["decode_steps"] < 3:  # one token per decode step
        time.sleep(0.001)
    (partial,) = engine.abort()
    t.join(60)
    assert partial.finish_reason == "abort" and 3 <= len(partial.token_ids) < 500
    assert out["c"].token_ids == partial.token_ids
    ref = reference_logprobs(0, [1, 2], partial.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(partial.logprobs, ref)) <= 1e-4


def test_compaction_gives_the_same_samples_with_fewer_row_steps():
    reqs = [
        GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4 + 12 * i, seed=i), f"r{i}")
        for i in range(4)
    ]
    outs, stats = {}, {}
    for compact in (True, False):
        with TorchEngine(ARGS, in_process=True, compact=compact) as eng:
            publish_model(eng, model_of(0))
            outs[compact] = eng.generate(reqs)
            stats[compact] = eng.stats()
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert stats[True]["row_steps"] == sum(4 + 12 * i for i in range(4))
    assert stats[False]["row_steps"] == 4 * (4 + 12 * 3)


def test_sample_next_top_k_top_p_and_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    gen = torch.Generator().manual_seed(0)
    temp = torch.tensor([0.0, 1.0, 1.0, 0.5])
    top_k = torch.tensor([0, 1, 3, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1e-6])
    top3 = logits[2].topk(3).indices.tolist()
    for _ in range(20):
        tok, lp = sample_next(logits, temp, top_k, top_p, torch.rand(4, generator=gen))
        assert tok[0] == logits[0].argmax() and tok[1] == logits[1].argmax()
        assert tok[2] in top3 and tok[3] == logits[3].argmax()
    # reported logprob: log_softmax(logits / T) over the full vocabulary (not renormalised)
    full = torch.log_softmax(logits / torch.tensor([1.0, 1.0, 1.0, 0.5])[:, None], -1)
    assert torch.allclose(lp, full.gather(-1, tok[:, None]).squeeze(-1))
    # without filtering the empirical distribution matches softmax(logits / T)
    small = torch.tensor([[0.0, 1.0, 2.0]])
    counts = torch.zeros(3)
    for u in request_uniforms(0, 3000):
        t, _ = sample_next(
            small, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), u[None]
        )
        counts[t] += 1
    assert torch.allclose(counts / 3000, torch.softmax(small[0], -1), atol=0.03)


@pytest.mark.parametrize("vocab", [3, 256, 300, 32_000])
def test_two_level_inverse_cdf_draws_what_a_full_float64_cumsum_draws(vocab):
    """Block sums + one in-block cumsum pick the same token as searching the full float64 cdf,
    and never a token of zero mass (zeros, a short last block, underflowed tails)."""
    gen = torch.Generator().manual_seed(vocab)
    for scale in (0.5, 3.0, 30.0):
        z = torch.randn(16, vocab, generator=gen) * scale
        probs = (z - z.amax(-1, keepdim=True)).exp()
        probs[:, torch.randperm(vocab, generator=gen)[: vocab // 3]] = 0.0
        probs[torch.arange(16), z.argmax(-1)] = 1.0
        u = torch.rand(16, generator=gen)
        cdf = probs.double().cumsum(-1)
        want = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)
        got = inverse_cdf(probs, block_sums(probs), u)
        assert torch.equal(got, want.squeeze(-1))
        assert bool((probs.gather(1, got[:, None]) > 0).all())
    # u right at the ends of [0, 1) still lands on tokens with mass
    probs = torch.zeros(2, vocab)
    probs[:, vocab // 2] = 1.0
    edges = inverse_cdf(probs, block_sums(probs), torch.tensor([0.0, 1 - 2**-24]))
    assert edges.tolist() == [vocab // 2, vocab // 2]


def test_top_k_top_p_filter_equals_ranking_the_whole_vocabulary():
    """The filter ranks only the head of each row (topk, widened as needed): the kept set must
    equal the one from sorting all V entries, for small and large nuclei."""
    gen = torch.Generator().manual_seed(0)
    for vocab, scale in [(50, 1.0), (5000, 0.2), (5000, 2.0), (32_000, 4.0), (32_000, 0.3)]:
        probs = (torch.randn(12, vocab, generator=gen) * scale).softmax(-1)
        top_k = torch.tensor([0, 0, 0, 0, 5, 40, 0, 3, 0, 100, 0, 0])
        top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 1.0, 0.95, 0.1, 0.7, 1.0, 1.0, 0.8, 0.999])
        ranked, order = probs.sort(-1, descending=True)
        mass_before = (ranked.double().cumsum(-1) - ranked.double()) / ranked.double().sum(-1, True)
        rank = torch.arange(vocab)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        keep &= (top_p[:, None] >= 1) | (mass_before < top_p[:, None])  # top_p = 1: off
        want = torch.zeros_like(keep).scatter(-1, order, keep)
        got = filter_top_k_top_p(probs, top_k, top_p)
        assert torch.equal(got > 0, want), (vocab, scale)
        assert torch.equal(got[want], probs[want])  # kept mass is not renormalised


@pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.float32), reason="needs oneDNN"
)
def test_packed_linears_keep_names_and_outputs_and_follow_publishes():
    model = init_weights(
        Transformer(dataclasses.replace(ARGS, qkv_bias=True, tie_word_embeddings=False)),
        seed=3,
        std=0.1,
    ).eval()
    names = [n for n, _ in model.named_parameters()]
    ids = torch.randint(1, ARGS.vocab_size, (3, 9))
    with torch.no_grad():
        want = model(ids)
        packed_model = copy.deepcopy(model)
        layers = pack_linears(packed_model)
        assert len(layers) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert [n for n, _ in packed_model.named_parameters()] == names
        assert (packed_model(ids) - want).abs().max() <= 1e-5
        # new weights reach the packed kernels only through repack(), which a publish calls
        for p in packed_model.parameters():
            p.mul_(0.5)
        for layer in layers:
            layer.repack()
        for p in model.parameters():
            p.mul_(0.5)
        assert (packed_model(ids) - model(ids)).abs().max() <= 1e-5
    with TorchEngine(ARGS, in_process=True) as eng:
        assert eng.stats()["linear_kernel"] == "onednn_packed"


@pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.float32), reason="needs oneDNN"
)
def test_packed_linear_op_reads_the_current_packed_weights():
    """The custom op that compiled graphs call instead of the packed kernel (compile=True)."""
    lin = torch.nn.Linear(16, 24)
    (layer,) = pack_linears(torch.nn.Sequential(lin))
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert (
            torch.ops.minippo.packed_linear(x, lin.weight, lin.bias) - lin(x)
        ).abs().max() < 1e-5
        lin.weight.mul_(-2.0)
        layer.repack()  # what a publish does
        assert (
            torch.ops.minippo.packed_linear(x, lin.weight, lin.bias) - lin(x)
        ).abs().max() < 1e-5
        layer.drop()  # what sleep does
        with pytest.raises(RuntimeError, match="no packed copy"):
            torch.ops.minippo.packed_linear(x, lin.weight, lin.bias)


def test_sample_unfiltered_equals_sample_next_for_plain_rows():
    """The fixed-shape sampler that compile=True compiles: sample_next's numbers exactly."""
    gen = torch.Generator().manual_seed(5)
    for k, vocab, t in [(4, 300, None), (6, 32_000, None), (3, 1000, 1.0)]:
        logits = torch.randn(k, vocab, generator=gen) * 3
        temperature = torch.full((k,), t) if t else torch.rand(k, generator=gen) + 0.2
        u = torch.rand(k, generator=gen)
        zeros, ones = torch.zeros(k, dtype=torch.long), torch.ones(k)
        want = sample_next(logits, temperature, zeros, ones, u)
        got = sample_unfiltered(logits, temperature, u)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prompt_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match="vocab"):
        engine.generate([GenerateRequest([1, ARGS.vocab_size], SamplingParams(), "x")])


def test_engine_process_generates_publishes_and_shuts_down_cleanly():
    eng = TorchEngine(ARGS, num_threads=1)
    proc = eng._process
    try:
        assert proc.is_alive()
        r = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=8, seed=4), "p")
        publish_model(eng, model_of(0))
        (c,) = eng.generate([r])
        ref = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-4
        with TorchEngine(ARGS, in_process=True) as same:  # same logic in-process
            publish_model(same, model_of(0))
            assert same.generate([r])[0].token_ids == c.token_ids
        eng.publish_weights(weights(1), version=1)
        (c1,) = eng.generate([r])
        assert c1.versions == [1] * 8
        ref1 = reference_logprobs(1, r.prompt_ids, c1.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(c1.logprobs, ref1)) <= 1e-4
    finally:
        eng.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0  # joined: no zombie
    eng.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate([r])


def test_compile_option_must_be_a_bool():
    with pytest.raises(TypeError, match=r"engine\.compile must be true or false"):
        TorchEngine(ARGS, in_process=True, compile="yes")
    with TorchEngine(ARGS, in_process=True) as eng:
        assert eng.stats()["compiled"] is False  # default off: nothing is compiled


def test_shared_bucket_crosses_a_pickle_as_the_bucket():
    """A publish to the engine process sends each bucket as one shared buffer per dtype; what
    the engine unpickles is the bucket: same names, shapes, dtypes and values, in order."""
    import pickle
    from multiprocessing.reduction import ForkingPickler  # with torch's shared-memory reducers

    from minippo.engine.torch_engine import _SharedBucket

    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c", torch.randn(4, 6, generator=gen).t()),  # not contiguous
        ("d", torch.randn(2, generator=gen)),
    ]
    shared = _SharedBucket(bucket)
    assert set(shared.buffers) == {torch.float32, torch.bfloat16}
    got = pickle.loads(ForkingPickler.dumps(shared))
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_engine_process_sets_its_kernel_cache_capacity():
    """``onednn_cache_capacity`` reaches the engine process before its first oneDNN kernel (the
    smallest capacity, 1, still generates the same tokens); a bad value is refused at once."""
    r = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=6, seed=0), "a")
    with publish_model(TorchEngine(ARGS, onednn_cache_capacity=1), model_of(0)) as eng:
        assert eng.stats()["onednn_cache_capacity"] == "1"
        (small,) = eng.generate([r])
    with publish_model(TorchEngine(ARGS, in_process=True), model_of(0)) as eng:
        (ref,) = eng.generate([r])
    assert small.token_ids == ref.token_ids
    for bad in (0, True, 2.0, "64"):
        with pytest.raises(ValueError, match=r"engine\.onednn_cache_capacity must be an integer"):
            TorchEngine(ARGS, onednn_cache_capacity=bad)


def test_built_from_the_config_and_refuses_to_generate_before_the_first_publish():
    """The recipe builds every engine as ``instantiate(cfg.engine, model_args=...)``; the engine
    starts without weights and the first publish must fill every parameter."""
    eng = instantiate(
        {"_component_": "minippo.engine.torch_engine.TorchEngine", "in_process": True},
        model_args=ARGS,
    )
    with eng:
        assert eng.dtype == torch.float32 and eng.version == 0
        r = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0), "a")
        with pytest.raises(RuntimeError, match="no weights published yet"):
            eng.generate([r])
        first, second = weights(0)
        eng.publish_weights([first], version=0)
        with pytest.raises(RuntimeError, match=r"publish_weights of version 0 failed.*never sent"):
            eng.wait_published()
        with pytest.raises(RuntimeError, match=r"never sent.*publish again before generating"):
            eng.generate([r])
        eng.publish_weights([second], version=0)  # now every parameter has been sent once
        (c,) = eng.generate([r])
        ref = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-4


def test_engine_dtype_in_either_spelling():
    for name, want in [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", None)]:
        with TorchEngine(ARGS, in_process=True, dtype=name) as eng:
            assert eng.dtype == (want or torch.float32)
    with pytest.raises(ValueError, match=r"engine\.dtype='int8'"):
        TorchEngine(ARGS, in_process=True, dtype="int8")
    with pytest.raises(TypeError, match="ModelArgs"):
        TorchEngine(model_of(0), in_process=True)


def test_bf16_engine_computes_in_bf16():
    """``dtype`` is the engine's compute dtype: published fp32 weights land in bf16 parameters, so
    its logprobs leave the fp32 model's by far more than the fp32 agreement bound (1e-4): rounding
    the weights alone to 8 significant bits moves the logits by ~1e-3 relative."""
    r = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=8, seed=3), "g")
    with TorchEngine(ARGS, in_process=True, dtype="bf16") as eng:
        publish_model(eng, model_of(0))
        (c,) = eng.generate([r])
    assert c.versions == [0] * 8
    ref = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)  # the fp32 model
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) > 1e-4


def test_uniforms_drawn_once_equal_one_draw_per_step():
    """Why a request's tokens did not change when its uniforms became one draw per request: a CPU
    generator gives the same numbers to ``rand(n)`` as to n calls of ``rand(1)``."""
    for seed in (0, 7, 2**61):
        g = torch.Generator().manual_seed(seed)
        per_step = torch.cat([torch.rand(1, generator=g) for _ in range(300)])
        assert torch.equal(request_uniforms(seed, 300), per_step)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_engine_samples_from_the_rounded_model(fmt):
    """``engine.quantize``: the engine's logprobs are those of the model with its linear layers
    rounded (minippo.engine.quantize), not the published fp32 model's. int8 and int4 round only
    the weights, so every token agrees with the rounded model to the fp32 bound (1e-4, as above).
    FP8 also rounds each linear input per token: the decode step and the teacher-forced forward
    compute those inputs in a different order, and a value within float32 rounding of an FP8
    rounding boundary may round the other way, so the median token is held to the bound."""
    import copy
    import statistics

    from minippo.engine.quantize import quantize_linear_inputs, quantize_linear_weights_

    rounded = copy.deepcopy(model_of(0))
    quantize_linear_weights_(rounded, fmt)
    hooks = quantize_linear_inputs(rounded, fmt)
    reqs = [req([1 + i, 2, 3 + 2 * i], f"q{i}", max_new_tokens=12, seed=i) for i in range(4)]
    with TorchEngine(ARGS, in_process=True, quantize=fmt) as eng:
        publish_model(eng, model_of(0))
        outs = eng.generate(reqs)
        publish_model(eng, model_of(0), version=1)  # rounding again after a publish changes nothing
        again = eng.generate(reqs)
    to_rounded, to_fp32 = [], []
    for c, c2, r in zip(outs, again, reqs):
        assert c.token_ids == c2.token_ids and c.logprobs == c2.logprobs
        ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
        with torch.no_grad():
            ref = token_logprobs(rounded, ids, start=len(r.prompt_ids))[0].tolist()
            fp32 = token_logprobs(model_of(0), ids, start=len(r.prompt_ids))[0].tolist()
        to_rounded += [abs(a - b) for a, b in zip(c.logprobs, ref)]
        to_fp32 += [abs(a - b) for a, b in zip(c.logprobs, fp32)]
    for h in hooks:
        h.remove()
    if fmt != "fp8":
        assert max(to_rounded) <= 1e-4
    else:
        assert statistics.median(to_rounded) <= 1e-4
    # and the gap to the trainer's fp32 model is far beyond the fp32 agreement bound
    assert statistics.fmean(to_fp32) > 10 * 1e-4, statistics.fmean(to_fp32)


def test_unknown_quantize_format_is_refused():
    with pytest.raises(ValueError, match=r"engine\.quantize must be null or one of"):
        TorchEngine(ARGS, in_process=True, quantize="int2")


def test_a_dead_engine_mid_handover_prints_no_traceback(monkeypatch, capsys):
    """The fd handover thread of multiprocessing (``resource_sharer``) reports a peer that died
    mid-exchange through ``sys.excepthook``; the engine's hook drops exactly that (the trainer
    reports the engine's death in one line) unless MINIPPO_LOG_LEVEL=DEBUG."""
    import sys

    from minippo.engine.torch_engine import _quiet_dead_peer_handovers

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    _quiet_dead_peer_handovers()
    _quiet_dead_peer_handovers()  # installed once

    def raised_in(filename: str, exc: str) -> tuple:
        """exc_info of ``exc`` raised and caught in code of ``filename`` (as _serve catches)."""
        src = f"import sys\ntry:\n    raise {exc}('peer gone')\nexcept BaseException:\n"
        src += "    info = sys.exc_info()\n"
        namespace: dict = {}
        exec(compile(src, filename, "exec"), namespace)
        return namespace["info"]

    sharer = "/usr/lib/python3/multiprocessing/resource_sharer.py"
    monkeypatch.delenv("MINIPPO_LOG_LEVEL", raising=False)
    sys.excepthook(*raised_in(sharer, "ConnectionResetError"))
    assert capsys.readouterr().err == ""
    sys.excepthook(*raised_in(sharer, "ValueError"))  # not a connection error: shown
    sys.excepthook(*raised_in("/somewhere/else.py", "ConnectionResetError"))  # elsewhere: shown
    assert capsys.readouterr().err.count("Traceback") == 2
    monkeypatch.setenv("MINIPPO_LOG_LEVEL", "DEBUG")
    sys.excepthook(*raised_in(sharer, "ConnectionResetError"))
    assert "ConnectionResetError: peer gone" in capsys.readouterr().err
