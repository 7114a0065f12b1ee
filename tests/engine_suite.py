"""The engine-protocol test suite, shared by every RolloutEngine backend.

How to run it against a backend: subclass ``EngineProtocolSuite`` in a test module (its name must
start with ``Test``) and give it a ``harness`` fixture returning an :class:`EngineHarness`::

    from tests.engine_suite import EngineHarness, EngineProtocolSuite

    class TestMyEngine(EngineProtocolSuite):
        @pytest.fixture
        def harness(self):
            return EngineHarness(make_engine=..., vocab_size=..., max_seq_len=..., weights=...)

Every test method of the suite then runs against that backend (a fresh engine per test, shut down
afterwards). Checks that need real numerics (logprobs against a reference forward) run only when
the harness provides ``reference_logprobs``; the batch-invariance check only when
``batch_invariant`` is True; the sampling-distribution check (μ is what the engine samples from)
only when ``mu_draws`` > 0. A stand-in engine (e.g. a recording fake of SGLang) passes the suite
if it follows the protocol: structure, lengths, stops, versions, pause/resume, abort, errors.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from minippo.engine import (
    FINISH_REASONS,
    Completion,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
)


@dataclass
class EngineHarness:
    """What the suite needs to know about a backend.

    Fields:
        make_engine:        builds a fresh engine holding the weights of version 0 (engines start
                            without weights: publish them, e.g. with :func:`publish_model`).
        vocab_size:         V; every generated id must be in [0, V).
        max_seq_len:        the engine's context length (prompt + max_new_tokens limit).
        weights:            ``weights(version) -> buckets`` of (HF name, tensor) for a distinct set
                            of weights per version (version 0 = the engine's initial weights).
        reference_logprobs: optional ``(version, prompt_ids, token_ids, temperature) -> list of
                            floats``: the trainer's teacher-forced logprobs of ``token_ids`` under
                            the weights of ``version`` (temperature 0 means 1).
        logprob_tol:        max |engine - reference| allowed.
        batch_invariant:    seeded requests give the same tokens whatever else is in the batch.
        long_tokens:        max_new_tokens of a request that is still running ~50 ms after it
                            was submitted (for the pause and abort tests); must fit max_seq_len.
        prompt:             a valid prompt.
        exact_stops:        ``stream(..., until_groups=k)`` stops the other requests right after the
                            decode step that completed the k-th group (TorchEngine); False: a few
                            more tokens may come (SGLang stops them when its loop sees it).
        mu_draws:           draws per sampling setting of the sampling-distribution check
                            (``test_sampled_frequencies_match_reported_logprobs``): that many
                            seeded one-token requests, all in one ``generate`` call; 0 skips the
                            check. 4000 gives the bound in :func:`chi_square_p_value`'s caller.
        seeded:             None when the backend honours request seeds; else the reason it does
                            not (the seed tests skip with it).
    """

    make_engine: Callable[[], RolloutEngine]
    vocab_size: int
    max_seq_len: int
    weights: Callable[[int], list[WeightBucket]]
    reference_logprobs: Callable[[int, list[int], list[int], float], list[float]] | None = None
    logprob_tol: float = 1e-4
    batch_invariant: bool = True
    long_tokens: int = 400
    prompt: tuple[int, ...] = (1, 2, 3)
    exact_stops: bool = True
    mu_draws: int = 0
    seeded: str | None = None


def publish_model(engine: RolloutEngine, model: torch.nn.Module, version: int = 0):
    """Publish ``model``'s weights into ``engine`` as ``version``, cast to the engine's dtype as the
    recipe does (HF names, buckets of 1 MiB); return the engine. Engines are built from the model
    config without weights, so this is how a test fills one."""
    from minippo.parallel import full_tensor_buckets

    buckets = full_tensor_buckets(model, bucket_bytes=1 << 20, dtype=engine.dtype)
    engine.publish_weights(buckets, version=version)
    return engine


def req(prompt, rid, **params) -> GenerateRequest:
    return GenerateRequest(list(prompt), SamplingParams(**params), rid)


def reference_logprobs_of(
    model_of: Callable[[int], torch.nn.Module],
) -> Callable[[int, list[int], list[int], float], list[float]]:
    """A harness ``reference_logprobs``: the teacher-forced ``token_logprobs`` of ``token_ids``
    under ``model_of(version)`` (temperature 0 means 1)."""
    from minippo.models import token_logprobs

    @torch.no_grad()
    def reference_logprobs(version, prompt_ids, token_ids, temperature):
        ids = torch.tensor([list(prompt_ids) + list(token_ids)])
        lp = token_logprobs(
            model_of(version), ids, temperature=temperature or 1.0, start=len(prompt_ids)
        )
        return lp[0].tolist()

    return reference_logprobs


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One torch thread for every test of a module that imports this fixture, restored afterwards:
    tiny matmuls run fastest on one thread, and engines that run forwards on their own loop thread
    (the SGLang stand-in) are ~100x slower with several OpenMP threads per calling thread on a
    loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_completion(c: Completion, r: GenerateRequest, vocab_size: int) -> None:
    """Structural invariants of one completion of request ``r``."""
    assert c.request_id == r.request_id
    assert list(c.prompt_ids) == list(r.prompt_ids)
    assert c.finish_reason in FINISH_REASONS
    n = len(c.token_ids)
    assert len(c.logprobs) == n and len(c.versions) == n
    assert n <= r.params.max_new_tokens
    assert all(0 <= t < vocab_size for t in c.token_ids)
    assert all(lp <= 1e-6 for lp in c.logprobs)  # log-probabilities
    assert c.versions == sorted(c.versions)  # versions never decrease along a response
    stops = set(r.params.stop_token_ids)
    if c.finish_reason == "stop":
        assert n >= 1 and c.token_ids[-1] in stops
    if c.finish_reason == "length":
        assert n == r.params.max_new_tokens
    if c.finish_reason == "abort":  # unfinished: below the budget, no stop id at all
        assert n < r.params.max_new_tokens, f"{c.request_id}: an abort holding {n} tokens"
        assert not stops & set(c.token_ids), f"{c.request_id}: an abort ending in a stop id"
    else:  # no stop id before the end
        assert not stops & set(c.token_ids[:-1])


def run_in_thread(fn):
    """Start ``fn()`` in a daemon thread; returns ``(thread, box)`` for :func:`join`."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def join(t, box, timeout=120):
    """Wait for a :func:`run_in_thread` thread; returns its result or raises its exception."""
    t.join(timeout)
    assert not t.is_alive(), "generate did not return"
    if "error" in box:
        raise box["error"]
    return box["result"]


def kept_tokens(logprobs: torch.Tensor, top_k: int, top_p: float) -> list[int]:
    """The tokens that top-k / top-p keep, given the full-vocabulary ``log_softmax(z / T)``
    ``[V]``: rank < k (k = 0: all), and the mass of the tokens ranked before < p (the most likely
    token is always kept); the protocol's definition (docs/engine.md, SamplingParams)."""
    probs = logprobs.double().exp()
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    keep = (before < top_p) if top_p < 1 else torch.ones_like(before, dtype=torch.bool)
    if top_k > 0:
        keep &= torch.arange(len(order)) < top_k
    return sorted(order[keep].tolist())


def chi_square_p_value(counts: list[int], probs: list[float], pool_below: float = 5.0) -> float:
    """Pearson's goodness-of-fit test of ``counts`` (one per bin) against bin probabilities
    ``probs`` (summing to 1): the probability that a multinomial sample of the same size gives a
    statistic X² = Σ (o − e)² / e at least as large. Bins whose expected count e is below
    ``pool_below`` are pooled (ascending by e, until each pool reaches it), the usual condition
    for the χ² approximation; the p-value is the χ² survival function Q(df/2, X²/2) with
    df = bins − 1."""
    n = sum(counts)
    bins = sorted(zip((n * p for p in probs), counts))
    pooled: list[list[float]] = []
    acc = [0.0, 0.0]
    for e, o in bins:
        acc = [acc[0] + e, acc[1] + o]
        if acc[0] >= pool_below:
            pooled.append(acc)
            acc = [0.0, 0.0]
    if acc[0] > 0 or acc[1] > 0:  # the remainder joins the last pool
        if pooled:
            pooled[-1] = [pooled[-1][0] + acc[0], pooled[-1][1] + acc[1]]
        else:
            pooled.append(acc)
    stat = sum((o - e) ** 2 / e for e, o in pooled if e > 0)
    if any(e <= 0 and o > 0 for e, o in pooled):
        return 0.0  # a draw where the expected mass is zero
    df = len(pooled) - 1
    if df < 1:
        return 1.0
    q = torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    )
    return float(q)


# Sampling settings of the μ check: temperatures below, at and above 1, then top-k and top-p
MU_CASES = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.7, top_p=0.5),
    dict(temperature=0.5, top_k=8, top_p=0.9),
]
MU_FALSE_ALARM = 1e-6  # the χ² test's significance level


class EngineProtocolSuite:
    """Protocol checks; subclass with a ``harness`` fixture (see the module docstring)."""

    @pytest.fixture
    def engine(self, harness: EngineHarness):
        eng = harness.make_engine()
        yield eng
        eng.shutdown()

    def test_implements_protocol(self, engine):
        assert isinstance(engine, RolloutEngine)
        assert engine.version == 0
        assert isinstance(engine.dtype, torch.dtype)

    def test_completions_structure_and_order(self, engine, harness):
        reqs = [
            req(
                harness.prompt[: 1 + i % len(harness.prompt)], f"r{i}", max_new_tokens=3 + i, seed=i
            )
            for i in range(5)
        ]
        outs = engine.generate(reqs)
        assert [c.request_id for c in outs] == [r.request_id for r in reqs]
        for c, r in zip(outs, reqs):
            check_completion(c, r, harness.vocab_size)
            assert c.versions == [0] * len(c.token_ids)
        assert engine.generate([]) == []

    def test_max_new_tokens_gives_length(self, engine, harness):
        (c,) = engine.generate([req(harness.prompt, "a", max_new_tokens=7, seed=1)])
        assert len(c.token_ids) == 7 and c.finish_reason == "length"

    def test_stop_token_ids(self, engine, harness):
        (free,) = engine.generate([req(harness.prompt, "a", temperature=0, max_new_tokens=12)])
        stop = free.token_ids[4]
        first = free.token_ids.index(stop)
        (c,) = engine.generate(
            [req(harness.prompt, "b", temperature=0, max_new_tokens=12, stop_token_ids=(stop,))]
        )
        assert c.finish_reason == "stop"
        assert c.token_ids == free.token_ids[: first + 1]

    def test_seeded_requests_are_reproducible(self, engine, harness):
        if harness.seeded is not None:
            pytest.skip(harness.seeded)
        reqs = [req(harness.prompt, f"r{i}", max_new_tokens=16, seed=100 + i) for i in range(3)]
        a = engine.generate(reqs)
        b = engine.generate(reqs)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert len({tuple(c.token_ids) for c in a}) > 1  # different seeds, different samples

    def test_seeded_requests_do_not_depend_on_the_batch(self, engine, harness):
        if harness.seeded is not None:
            pytest.skip(harness.seeded)
        if not harness.batch_invariant:
            pytest.skip("this backend does not promise batch-invariant sampling")
        target = req(harness.prompt, "t", max_new_tokens=16, seed=7)
        (alone,) = engine.generate([target])
        others = [req(harness.prompt[:1], f"o{i}", max_new_tokens=4 + i, seed=i) for i in range(3)]
        mixed = engine.generate([others[0], target, *others[1:]])
        assert mixed[1].token_ids == alone.token_ids

    @pytest.mark.parametrize(
        "bad, match",
        [
            (dict(prompt=()), "empty prompt"),
            (dict(temperature=-0.5), "temperature"),
            (dict(temperature=math.nan), "temperature must be a finite number"),
            (dict(temperature=math.inf), "temperature must be a finite number"),
            (dict(stop_token_ids=(2, -1)), "stop_token_ids must be >= 0"),
            (dict(top_p=0.0), "top_p"),
            (dict(top_p=1.5), "top_p"),
            (dict(top_k=-1), "top_k"),
            (dict(max_new_tokens=0), "max_new_tokens"),
            (dict(too_long=True), "max_seq_len"),
        ],
    )
    def test_bad_requests_raise_before_generating(self, engine, harness, bad, match):
        bad = dict(bad)
        prompt = bad.pop("prompt", harness.prompt)
        if bad.pop("too_long", False):
            prompt = [1] * harness.max_seq_len
        good = req(harness.prompt, "good", max_new_tokens=4, seed=0)
        wrong = GenerateRequest(list(prompt), SamplingParams(**{"max_new_tokens": 4, **bad}), "bad")
        with pytest.raises(ValueError, match=match):
            engine.generate([good, wrong])
        (c,) = engine.generate([good])  # the engine is still usable
        check_completion(c, good, harness.vocab_size)

    def test_publish_weights_stamps_the_new_version(self, engine, harness):
        r = req(harness.prompt, "a", max_new_tokens=6, seed=3)
        (before,) = engine.generate([r])
        engine.publish_weights(harness.weights(1), version=1)
        assert engine.version == 1
        (after,) = engine.generate([r])
        assert before.versions == [0] * 6 and after.versions == [1] * 6
        if harness.reference_logprobs is not None:
            ref = harness.reference_logprobs(1, r.prompt_ids, after.token_ids, 1.0)
            assert max(abs(a - b) for a, b in zip(after.logprobs, ref)) <= harness.logprob_tol
        with pytest.raises(ValueError, match="version"):
            engine.publish_weights(harness.weights(0), version=0)

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_logprobs_match_reference(self, engine, harness, temperature):
        if harness.reference_logprobs is None:
            pytest.skip("no reference model for this backend")
        reqs = [
            req(
                harness.prompt[: 1 + i], f"r{i}", temperature=temperature, max_new_tokens=12, seed=i
            )
            for i in range(len(harness.prompt))
        ]
        worst = 0.0
        for c, r in zip(engine.generate(reqs), reqs):
            ref = harness.reference_logprobs(0, r.prompt_ids, c.token_ids, temperature)
            worst = max(worst, *(abs(a - b) for a, b in zip(c.logprobs, ref)))
        assert worst <= harness.logprob_tol, worst

    def test_multi_turn_logprobs_match_one_forward_of_the_whole_episode(self, engine, harness):
        """A 3-turn episode as the rollout queue runs it: each turn's request is the exact
        context so far (prompt, sampled ids, observation ids); the engine's logprobs of every
        turn equal the trainer's ONE teacher-forced forward of the whole episode at the model
        tokens' positions (alignment at the turn junctions: positions across observations)."""
        if harness.reference_logprobs is None:
            pytest.skip("no reference model for this backend")
        obs = [3, 4, 5, 6][: max(1, min(4, harness.vocab_size - 1))]
        context, model_at, engine_lp = list(harness.prompt), [], []
        for turn in range(3):
            r = req(context, f"turn{turn}", temperature=1.0, max_new_tokens=5, seed=11 + turn)
            (c,) = engine.generate([r])
            assert c.prompt_ids == context  # token in: the request is the context as it is
            model_at += range(len(context), len(context) + len(c.token_ids))
            engine_lp += c.logprobs
            context = context + c.token_ids + (obs if turn < 2 else [])
        start = len(harness.prompt)
        ref = harness.reference_logprobs(0, harness.prompt, context[start:], 1.0)
        ref_at_model = [ref[i - start] for i in model_at]
        worst = max(abs(a - b) for a, b in zip(engine_lp, ref_at_model, strict=True))
        assert worst <= harness.logprob_tol, worst

    def test_pause_publish_resume_continues_under_new_weights(self, engine, harness):
        r = req(harness.prompt, "long", max_new_tokens=harness.long_tokens, seed=5)
        t, box = run_in_thread(lambda: engine.generate([r]))
        time.sleep(0.05)
        engine.pause()
        engine.publish_weights(harness.weights(1), version=1)
        engine.resume()
        (c,) = join(t, box)
        check_completion(c, r, harness.vocab_size)
        assert set(c.versions) <= {0, 1}
        (c2,) = engine.generate([req(harness.prompt, "next", max_new_tokens=3, seed=1)])
        assert c2.versions == [1, 1, 1]

    def test_generate_waits_while_paused(self, engine, harness):
        engine.pause()
        t, box = run_in_thread(
            lambda: engine.generate([req(harness.prompt, "p", max_new_tokens=3, seed=0)])
        )
        time.sleep(0.2)
        assert t.is_alive()  # nothing is produced while paused
        engine.resume()
        (c,) = join(t, box)
        assert len(c.token_ids) == 3

    def test_abort_returns_partial_completions(self, engine, harness):
        r = req(harness.prompt, "long", max_new_tokens=harness.long_tokens, seed=5)
        engine.pause()  # the request is in flight (or waiting) when abort arrives
        t, box = run_in_thread(lambda: engine.generate([r]))
        time.sleep(0.1)
        partial = engine.abort()
        (c,) = join(t, box)
        engine.resume()
        assert c.finish_reason == "abort"
        check_completion(c, r, harness.vocab_size)
        assert [p.request_id for p in partial] == ["long"]
        assert partial[0].token_ids == c.token_ids
        (c2,) = engine.generate([req(harness.prompt, "after", max_new_tokens=2, seed=0)])
        assert c2.finish_reason == "length"  # usable after an abort

    def test_concurrent_generate_calls(self, engine, harness):
        calls = [
            [
                req(harness.prompt, f"c{j}-{i}", max_new_tokens=5 + i, seed=10 * j + i)
                for i in range(3)
            ]
            for j in range(3)
        ]
        threads = [run_in_thread(lambda rs=rs: engine.generate(rs)) for rs in calls]
        for (t, box), rs in zip(threads, calls):
            outs = join(t, box)
            assert [c.request_id for c in outs] == [r.request_id for r in rs]
            for c, r in zip(outs, rs):
                check_completion(c, r, harness.vocab_size)
                assert c.finish_reason == "length"

    def test_stream_yields_completions_in_finishing_order(self, engine, harness):
        lengths = [5, 2, 8, 3]
        reqs = [req(harness.prompt, f"r{n}", max_new_tokens=n, seed=n) for n in lengths]
        outs = list(engine.stream(reqs))
        assert [c.request_id for c in outs] == ["r2", "r3", "r5", "r8"]
        by_id = {r.request_id: r for r in reqs}
        for c in outs:
            check_completion(c, by_id[c.request_id], harness.vocab_size)
            assert c.finish_reason == "length" and c.versions == [0] * len(c.token_ids)

    def _grouped(self, harness, tail_tokens: int) -> list[GenerateRequest]:
        """Groups a (2 and 3 tokens), b (4 and 5 tokens), c (one long request)."""
        spec = [("a", 2), ("a", 3), ("b", 4), ("b", 5), ("c", tail_tokens)]
        return [
            GenerateRequest(
                list(harness.prompt),
                SamplingParams(max_new_tokens=n, seed=i),
                request_id=f"{g}{i}",
                group=g,
            )
            for i, (g, n) in enumerate(spec)
        ]

    def test_stream_until_groups_stops_the_rest_as_partials(self, engine, harness):
        reqs = self._grouped(harness, tail_tokens=harness.long_tokens)
        outs = list(engine.stream(reqs, until_groups=2))
        assert [c.request_id for c in outs] == ["a0", "a1", "b2", "b3", "c4"]
        assert [c.finish_reason for c in outs] == ["length"] * 4 + ["abort"]
        for c, r in zip(outs, reqs):
            check_completion(c, r, harness.vocab_size)
        tail = outs[-1]
        assert len(tail.token_ids) < harness.long_tokens
        if harness.exact_stops:  # stopped after the step that completed group b
            assert len(tail.token_ids) == 5
            again = list(engine.stream(self._grouped(harness, harness.long_tokens), until_groups=2))
            assert [c.token_ids for c in again] == [c.token_ids for c in outs]
        engine.sleep()  # nothing of the call is left in flight
        engine.wake()

    def test_stream_until_groups_counts_only_groups_that_can_complete(self, engine, harness):
        """Group a finishes first, but one of its requests says ``completes_group=False`` (a turn
        its caller continues): the call stops only once group b is complete."""
        reqs = self._grouped(harness, tail_tokens=harness.long_tokens)
        reqs[1] = replace(reqs[1], completes_group=False)
        outs = list(engine.stream(reqs, until_groups=1))
        assert [c.request_id for c in outs] == ["a0", "a1", "b2", "b3", "c4"]
        assert [c.finish_reason for c in outs] == ["length"] * 4 + ["abort"]
        for c, r in zip(outs, reqs):
            check_completion(c, r, harness.vocab_size)
        if harness.exact_stops:  # stopped after the step that completed group b, not group a
            assert len(outs[-1].token_ids) == 5

    def test_stream_until_more_groups_than_exist_runs_to_the_end(self, engine, harness):
        outs = list(engine.stream(self._grouped(harness, tail_tokens=6), until_groups=5))
        assert [c.finish_reason for c in outs] == ["length"] * 5

    def test_stream_closed_early_stops_the_rest(self, engine, harness):
        reqs = [req(harness.prompt, "short", max_new_tokens=1, seed=0)] + [
            req(harness.prompt, f"long{i}", max_new_tokens=harness.long_tokens, seed=i)
            for i in range(2)
        ]
        it = engine.stream(reqs)
        assert next(it).request_id == "short"
        it.close()
        deadline = time.monotonic() + 30
        while True:  # the engine becomes idle (an SGLang abort may take a moment to land)
            try:
                engine.sleep()
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "the closed stream kept generating"
                time.sleep(0.05)
        engine.wake()
        engine.publish_weights(harness.weights(1), version=1)  # what a backend may need after wake
        (c,) = engine.generate([req(harness.prompt, "after", max_new_tokens=2, seed=0)])
        assert c.finish_reason == "length"

    def test_stream_refuses_bad_input_before_generating(self, engine, harness):
        with pytest.raises(ValueError, match="until_groups"):
            engine.stream([req(harness.prompt, "a", max_new_tokens=2)], until_groups=0)
        with pytest.raises(ValueError, match="twice"):
            engine.stream([req(harness.prompt, "a"), req(harness.prompt, "a")])

    def test_sleep_wake(self, engine, harness):
        engine.sleep()
        engine.wake()
        engine.publish_weights(harness.weights(1), version=1)  # what a backend may need after wake
        (c,) = engine.generate([req(harness.prompt, "a", max_new_tokens=3, seed=0)])
        assert c.versions == [1, 1, 1]

    def test_duplicate_request_ids_are_refused(self, engine, harness):
        reqs = [req(harness.prompt, rid, max_new_tokens=2, seed=0) for rid in ("a", "b", "a")]
        with pytest.raises(ValueError, match="request id 'a' appears twice"):
            engine.generate(reqs)
        (c,) = engine.generate(reqs[:1])  # the engine is still usable
        check_completion(c, reqs[0], harness.vocab_size)

    def test_publish_without_pause_mid_generation_stamps_exact_versions(self, engine, harness):
        """A publish while a request runs, without pause: the new weights take effect at the
        backend's point (TorchEngine between two decode steps, SGLang after the running
        requests); the versions never go back, and each token's logprob is the teacher-forced
        one under the weights of the version it carries."""
        r = req(harness.prompt, "long", max_new_tokens=harness.long_tokens, seed=5)
        t, box = run_in_thread(lambda: engine.generate([r]))
        time.sleep(0.05)
        engine.publish_weights(harness.weights(1), version=1)
        (c,) = join(t, box)
        check_completion(c, r, harness.vocab_size)
        assert set(c.versions) <= {0, 1} and c.versions[0] == 0
        assert engine.version == 1
        (after,) = engine.generate([req(harness.prompt, "after", max_new_tokens=3, seed=1)])
        assert after.versions == [1, 1, 1]
        if harness.reference_logprobs is not None:
            refs = {
                v: harness.reference_logprobs(v, r.prompt_ids, c.token_ids, 1.0) for v in (0, 1)
            }
            worst = max(
                abs(lp - refs[v][i]) for i, (lp, v) in enumerate(zip(c.logprobs, c.versions))
            )
            assert worst <= harness.logprob_tol, worst

    @pytest.mark.parametrize(
        "params", MU_CASES, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items())
    )
    def test_sampled_frequencies_match_reported_logprobs(self, engine, harness, params):
        """μ, the logprob the engine reports, is the distribution it samples from.

        ``mu_draws`` seeded one-token requests from one prompt. Each distinct token must report one
        logprob (the same distribution every time); the observed frequencies must fit
        exp(reported logprob) renormalised over the tokens top-k / top-p keep (Pearson's χ² at a
        false-alarm rate of 1e-6: the seeds are fixed, so a correct engine fails with probability
        1e-6 over the choice of seeds, and a sampler at another temperature than the one its
        logprobs report fails by far: at 4000 draws X² is in the thousands). With a reference
        model, each reported logprob also equals the teacher-forced log_softmax(z / T) and every
        drawn token lies in the kept set computed from the reference; without one, the kept set is
        the tokens drawn (top-k bounds their number) and, unfiltered, the undrawn tokens form one
        bin with the remaining mass 1 − Σ exp(reported)."""
        n = harness.mu_draws
        if n <= 0:
            pytest.skip("the harness sets mu_draws (draws per sampling setting) to run this check")
        top_k, top_p = params.get("top_k", 0), params.get("top_p", 1.0)
        T = params["temperature"]
        reqs = [
            req(harness.prompt, f"d{i}", max_new_tokens=1, seed=10_000 + i, **params)
            for i in range(n)
        ]
        outs = engine.generate(reqs)
        counts = Counter(c.token_ids[0] for c in outs)
        reported: dict[int, list[float]] = {}
        for c in outs:
            reported.setdefault(c.token_ids[0], []).append(c.logprobs[0])
        spread = max(max(v) - min(v) for v in reported.values())
        assert spread <= harness.logprob_tol, f"one token reports several logprobs ({spread})"
        lp = {tok: v[0] for tok, v in reported.items()}
        rest = 0.0  # probability of the bin of tokens never drawn
        if harness.reference_logprobs is not None:
            ref = torch.tensor(
                [
                    harness.reference_logprobs(0, list(harness.prompt), [v], T)[0]
                    for v in range(harness.vocab_size)
                ],
                dtype=torch.float64,
            )
            worst = max(abs(lp[tok] - float(ref[tok])) for tok in lp)
            assert worst <= harness.logprob_tol, (
                f"reported ≠ teacher-forced log_softmax(z/T): {worst}"
            )
            kept = kept_tokens(ref, top_k, top_p)
            outside = sorted(set(lp) - set(kept))
            assert not outside, f"drew tokens {outside} that top_k={top_k}, top_p={top_p} remove"
            logq = {v: lp.get(v, float(ref[v])) for v in kept}
        else:
            if top_k:
                assert len(lp) <= top_k, f"{len(lp)} distinct tokens with top_k={top_k}"
            logq = dict(lp)
            if not (top_k or top_p < 1):
                rest = 1.0 - sum(math.exp(x) for x in lp.values())
                assert rest >= -harness.logprob_tol * len(lp), f"reported mass {1 - rest} > 1"
                rest = max(rest, 0.0)
        mass = sum(math.exp(x) for x in logq.values())
        tokens = sorted(logq)
        probs = [math.exp(logq[v]) / (mass + rest) for v in tokens] + [rest / (mass + rest)]
        observed = [counts.get(v, 0) for v in tokens] + [0]
        p_value = chi_square_p_value(observed, probs)
        assert p_value >= MU_FALSE_ALARM, (params, p_value, counts.most_common(5))
