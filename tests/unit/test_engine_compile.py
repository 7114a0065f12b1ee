"""TorchEngine(compile=True): the protocol suite and exact checks with the compiled decode step.

Marked slow: the first compiled step of the process compiles the decode step and the sampler
(~15-60 s on a loaded 2-core machine); every later engine of the process reuses those graphs.
Measured here (printed with -s): max |compiled engine logprob - uncompiled engine logprob| and
max |compiled engine logprob - teacher-forced trainer logprob| in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo.utils

from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine._cpu_kernels import onednn_linear_available
from minippo.engine.sampling import sample_next, sample_unfiltered
from minippo.engine.torch_engine import TorchEngine
from minippo.models import Transformer, init_weights
from minippo.parallel import compilation_count
from tests.engine_suite import (
    EngineHarness,
    EngineProtocolSuite,
    one_torch_thread,  # noqa: F401 (autouse: one torch thread for this module)
    publish_model,
)
from tests.unit.test_engine_torch import ARGS, model_of, reference_logprobs, weights

pytestmark = pytest.mark.slow

# fp32: the compiled step fuses the same operations in another order (~1e-6 on these logits)
TOL = 1e-5


def compiled_engine() -> TorchEngine:
    return publish_model(TorchEngine(ARGS, in_process=True, compile=True), model_of(0))


class TestCompiledTorchEngineProtocol(EngineProtocolSuite):
    @pytest.fixture
    def harness(self):
        return EngineHarness(
            make_engine=compiled_engine,
            vocab_size=ARGS.vocab_size,
            max_seq_len=ARGS.max_seq_len,
            weights=weights,
            reference_logprobs=reference_logprobs,
            logprob_tol=TOL,
            long_tokens=ARGS.max_seq_len - 8,
            mu_draws=4000,
        )


def requests() -> list[GenerateRequest]:
    """Three waves: plain sampled rows (the compiled sampler), rows with top-k / top-p / greedy
    (the eager sampler, compiled decode step), both with mixed prompt lengths (left padding) and
    response lengths (compaction down to a single row, which runs eagerly); then plain rows with
    equal prompt lengths (no padding mask)."""
    opts = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.3)] * 2 + [
        dict(temperature=0.6, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=20, top_p=0.95, stop_token_ids=(3, 9)),
    ]
    mixed = [
        GenerateRequest(
            [1 + (7 * i + j) % 60 for j in range(1 + 3 * (i % 5))],
            SamplingParams(max_new_tokens=12 + 9 * i, seed=i, **o),
            f"r{i}",
        )
        for i, o in enumerate(opts)
    ]
    equal = [
        GenerateRequest([5, 6, 7, i], SamplingParams(max_new_tokens=20, seed=100 + i), f"e{i}")
        for i in range(4)
    ]
    return mixed + equal


WAVES = (slice(0, 6), slice(6, 10), slice(10, 14))  # one generate call each


def worst_vs_reference(outs, reqs, version: int) -> float:
    worst = 0.0
    for c, r in zip(outs, reqs):
        ref = reference_logprobs(version, r.prompt_ids, c.token_ids, r.params.temperature)
        worst = max(worst, *(abs(a - b) for a, b in zip(c.logprobs, ref)))
    return worst


def test_compiled_engine_returns_the_uncompiled_engines_tokens_and_logprobs():
    reqs = requests()
    with publish_model(TorchEngine(ARGS, in_process=True), model_of(0)) as eager:
        want = [c for wave in WAVES for c in eager.generate(reqs[wave])]
    with compiled_engine() as eng:
        got = [c for wave in WAVES for c in eng.generate(reqs[wave])]
        assert eng.stats()["compiled"] is True
    vs_eager = 0.0
    for a, b in zip(got, want):
        # ~1e-6 apart, a seeded draw lands on the same token unless its uniform falls within
        # ~1e-6 of a CDF boundary: compare the common prefix (all of it, in practice)
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        n = len(a.token_ids) if n is None else n
        assert n >= len(a.token_ids) // 2, (a.request_id, n)
        vs_eager = max(vs_eager, *(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])))
    vs_ref = worst_vs_reference(got, reqs, 0)
    print(f"\ncompiled vs uncompiled engine: {vs_eager:.3g}; vs trainer: {vs_ref:.3g}")
    assert vs_eager <= TOL and vs_ref <= TOL


@pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.float32), reason="needs oneDNN"
)
def test_publishes_and_sleep_wake_reach_the_compiled_step_without_recompiling():
    reqs = requests()[:6]
    with compiled_engine() as eng:
        eng.generate(reqs)  # compiles (or reuses this process's graphs)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # the packed kernels read the weights at run time: a publish repacks, nothing recompiles
        eng.publish_weights(weights(1), version=1)
        assert worst_vs_reference(eng.generate(reqs), reqs, 1) <= TOL
        eng.sleep()  # drops the packed weights
        eng.wake()  # packs them again
        outs = eng.generate(reqs)
        assert worst_vs_reference(outs, reqs, 1) <= TOL
        assert all(c.versions == [1] * len(c.token_ids) for c in outs)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        assert eng.stats()["sleeps"] == eng.stats()["wakes"] == 1


def test_compiled_sampler_draws_what_sample_next_draws():
    compiled = torch.compile(sample_unfiltered, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for k, vocab in [(5, 300), (8, 32_000)]:
        logits = torch.randn(k, vocab, generator=gen) * 4
        temperature = torch.rand(k, generator=gen) + 0.3
        u = torch.rand(k, generator=gen)
        zeros, ones = torch.zeros(k, dtype=torch.long), torch.ones(k)
        want_tok, want_lp = sample_next(logits, temperature, zeros, ones, u)
        tok, lp = compiled(logits, temperature, u)
        assert torch.equal(tok, want_tok)
        assert (lp - want_lp).abs().max() <= 1e-5


def test_a_deep_model_compiles_one_decode_graph_per_variant():
    """The decode step is one compiled frame over all the layers (``decode_logits`` inlines the
    blocks; each reads its own cache buffers), so a 12-layer model, more layers than the
    recompile limit of 8, compiles one graph per variant (padding mask or none) and the sampler
    at most once, not one per layer; waves of other batch sizes, prompt and response lengths
    compile nothing more, and no frame falls back to eager."""
    args = dataclasses.replace(ARGS, n_layers=12)
    model = init_weights(Transformer(args), seed=0, std=0.1)

    def wave(rows: int, prompt: int, new: int, padded: bool = True) -> list[GenerateRequest]:
        return [
            GenerateRequest(
                [1 + (7 * i + j) % 60 for j in range(prompt + (i % 3 if padded else 0))],
                SamplingParams(max_new_tokens=new + 2 * i, seed=i),
                f"w{rows}-{i}",
            )
            for i in range(rows)
        ]

    with publish_model(TorchEngine(args, in_process=True, compile=True), model) as eng:
        start = compilation_count()
        for reqs in (wave(4, 3, 6), wave(4, 3, 6, padded=False)):
            eng.generate(reqs)
        first = compilation_count()
        for reqs in (wave(6, 5, 9), wave(3, 2, 12), wave(5, 4, 4, padded=False)):
            eng.generate(reqs)
        assert compilation_count() == first
    assert 2 <= first["graphs"] - start["graphs"] <= 3  # 2 decode variants (+ the sampler)
    assert first["eager_frames"] == start["eager_frames"]
