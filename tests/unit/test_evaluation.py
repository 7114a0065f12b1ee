"""minippo.training.evaluation: the pass@k estimator against enumeration, and evaluate() on an
in-process TorchEngine with a tiny random model (metrics recomputed from its own rows)."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
import torch

from minippo.data import PerPositionMatch
from minippo.data.tasks import digit_task
from minippo.engine import SamplingParams
from minippo.engine.torch_engine import TorchEngine
from minippo.models import TinyTokenizer, Transformer, init_weights, qwen3_tiny
from minippo.training.evaluation import (
    EvalSample,
    evaluate,
    format_metrics,
    gather_samples,
    pass_at_k,
    read_samples,
    write_samples,
)
from minippo.training.rollout_queue import RewardError
from tests.engine_suite import one_torch_thread, publish_model  # noqa: F401 (autouse fixture)

EPS = 2.0**-53  # float64 unit roundoff


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_enumeration_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = brute_pass_at_k(n, c, k)
                # the product of c factors (1 - k/i), each rounded once, then 1 - prod: a relative
                # error of at most (2c + 1) ulps of numbers <= 1
                assert abs(pass_at_k(n, c, k) - float(exact)) <= (2 * c + 2) * EPS, (n, c, k)
        assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_pass_at_1_is_the_fraction_correct_and_large_n_is_stable():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=8 * EPS)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001, abs=1e3 * EPS)
    # C(150, 100) / C(200, 100) is ~1e-38 in binomials of ~1e58: the product form needs no bignum
    exact = 1 - Fraction(math.comb(150, 100), math.comb(200, 100))
    assert abs(pass_at_k(200, 50, 100) - float(exact)) <= 200 * EPS
    exact = 1 - Fraction(math.comb(190, 5), math.comb(200, 5))
    assert abs(pass_at_k(200, 10, 5) - float(exact)) <= 40 * EPS


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [(4, 5, 1, "c"), (4, -1, 1, "c"), (4, 2, 0, "k"), (4, 2, 5, "k")],
)
def test_pass_at_k_refuses_impossible_counts(n, c, k, match):
    with pytest.raises(ValueError, match=f"need .*{match}"):
        pass_at_k(n, c, k)
    with pytest.raises(TypeError, match="must be an int"):
        pass_at_k(4.0, 1, 1)


# ----------------------------------------------------------------------------------------------
# evaluate() on a real engine

ARGS = qwen3_tiny(vocab_size=51)  # TinyTokenizer's vocabulary: every sampled id decodes


@pytest.fixture(scope="module")
def engine():
    model = init_weights(Transformer(ARGS), seed=0)
    eng = publish_model(TorchEngine(ARGS, in_process=True), model)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.fixture(scope="module")
def data(tok):
    return digit_task(tok, op="copy", length=2, alphabet="01", num_prompts=12, seed=3)


class HasVowel:
    """1.0 when the response holds a vowel: about 1 sample in 4 of the random tiny model, so the
    prompts' correct counts spread over 0..4 (PerPositionMatch would score ~0 everywhere)."""

    max_value = 1.0

    def __call__(self, example, text: str) -> float:
        return float(any(ch in "aeiou" for ch in text))


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(2,))


def run(engine, data, tok, **kw):
    args = dict(
        reward_fn=PerPositionMatch(),
        decode=tok.decode,
        sampling=SAMPLING,
        samples_per_prompt=4,
        seed=5,
        correct_threshold=0.5,  # a random model gets one of two positions right now and then
    )
    return evaluate(engine, data, **(args | kw))


def test_metrics_are_those_of_the_rows(engine, data, tok):
    reward = HasVowel()
    result = run(engine, data, tok, pass_k=[1, 2, 4], reward_fn=reward, correct_threshold=None)
    rows, n = result.samples, 4
    assert [(r.prompt_index, r.sample) for r in rows] == [
        (i, j) for i in range(12) for j in range(n)
    ]
    for r in rows:
        assert r.prompt == data[r.prompt_index].prompt and r.answer == data[r.prompt_index].answer
        assert r.reward == reward(data[r.prompt_index], r.response)
        assert r.correct == (r.reward == 1.0)  # the reward's max_value
        assert 1 <= r.response_len <= 3 and r.finish_reason in ("stop", "length")
        if r.finish_reason == "length":  # cut at max_new_tokens; "stop": ended by the EOS id
            assert r.response_len == 3
    m = result.metrics
    correct = [sum(r.correct for r in rows[i * n : (i + 1) * n]) for i in range(12)]
    assert len(set(correct)) >= 3  # the pass@k below are not all 0 or all 1
    for k in (1, 2, 4):
        expected = sum(brute_pass_at_k(n, c, k) for c in correct) / 12
        assert abs(m[f"eval/pass@{k}"] - float(expected)) <= 16 * EPS, k
    assert m["eval/pass@1"] == pytest.approx(sum(correct) / 48, abs=16 * EPS)
    assert m["eval/reward_mean"] == math.fsum(r.reward for r in rows) / 48
    assert m["eval/response_len_mean"] == sum(r.response_len for r in rows) / 48
    assert m["eval/truncated_frac"] == sum(r.finish_reason == "length" for r in rows) / 48
    assert m["eval/prompts"] == 12.0 and m["eval/samples"] == 48.0
    assert set(m) == {
        *(f"eval/{k}" for k in ("reward_mean", "response_len_mean", "truncated_frac")),
        *(f"eval/pass@{k}" for k in (1, 2, 4)),
        "eval/prompts",
        "eval/samples",
    }
    assert "eval/pass@4" in format_metrics(m) and "  eval/samples" in format_metrics(m)


def test_default_pass_k_prefix_and_threshold(engine, data, tok):
    m = run(engine, data, tok, prefix="val/").metrics
    assert {k for k in m if "pass@" in k} == {"val/pass@1", "val/pass@4"}
    strict = run(engine, data, tok, correct_threshold=None).samples  # PerPositionMatch max 1.0
    assert all(r.correct == (r.reward >= 1.0) for r in strict)


def test_seeded_deterministic_and_no_global_rng_touched(engine, data, tok):
    torch.manual_seed(123)
    random.seed(123)
    seen: list[EvalSample] = []
    a = run(engine, data, tok, on_sample=seen.append)
    after = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(123)
    # the global generators are where the seeds left them: evaluate drew nothing from them
    assert torch.equal(torch.rand(3), after[0]) and random.random() == after[1]
    b = run(engine, data, tok)
    assert a.samples == b.samples and a.metrics == b.metrics
    assert sorted(seen, key=lambda s: (s.prompt_index, s.sample)) == a.samples
    other = run(engine, data, tok, seed=6)
    assert [r.response for r in other.samples] != [r.response for r in a.samples]


def test_bad_arguments_and_failing_rewards(engine, data, tok):
    with pytest.raises(ValueError, match="samples_per_prompt must be an integer >= 1"):
        run(engine, data, tok, samples_per_prompt=0)
    with pytest.raises(ValueError, match=r"pass_k must be integers in \[1, samples_per_prompt"):
        run(engine, data, tok, pass_k=[1, 5])
    with pytest.raises(ValueError, match="no examples"):
        run(engine, [], tok)

    def nan_reward(example, text):
        return float("nan")

    with pytest.raises(RewardError, match=r"nan_reward returned nan for prompt \d+"):
        run(engine, data, tok, reward_fn=nan_reward)


class DropsOne:
    """An engine that loses one completion (a request that never finishes nor aborts)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stream(self, requests, **kw):
        for i, c in enumerate(self.engine.stream(requests, **kw)):
            if i != 3:
                yield c


def test_a_lost_completion_is_an_error_not_a_shifted_row(engine, data, tok):
    """Rows are grouped by prompt from the completions that came back: a missing one must stop
    the evaluation, not move another prompt's sample into its place."""
    with pytest.raises(RuntimeError, match=r"no completion for 1 of 48 requests \(eval-"):
        run(DropsOne(engine), data, tok)


def test_samples_jsonl_round_trip(tmp_path, engine, data, tok):
    rows = gather_samples(list(reversed(run(engine, data, tok).samples)))  # one process: sorted
    path = write_samples(rows, tmp_path / "sub" / "samples.jsonl")
    back = read_samples(path)
    assert len(back) == 48 and [EvalSample(**r) for r in back] == rows
    assert set(back[0]) == {
        "prompt_index",
        "sample",
        "prompt",
        "answer",
        "response",
        "reward",
        "correct",
        "response_len",
        "finish_reason",
    }
    assert not (tmp_path / "sub" / "samples.jsonl.tmp").exists()
