"""validate_requests: the checks every engine runs before generating, with messages that name
the request and the fix; GroupCounter: when a stream with until_groups stops."""

import math
from dataclasses import replace

import pytest

from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine.protocol import GroupCounter, validate_requests


def req(rid="a", prompt=(1, 2), **params) -> GenerateRequest:
    return GenerateRequest(list(prompt), SamplingParams(**{"max_new_tokens": 4, **params}), rid)


def test_valid_requests_pass():
    validate_requests(
        [req("a"), req("b", temperature=0.0, stop_token_ids=(0, 3))], max_seq_len=16, vocab_size=8
    )


@pytest.mark.parametrize(
    "requests, match",
    [
        ([req("a"), req("b"), req("a")], "request id 'a' appears twice in one generate call"),
        ([req("a", stop_token_ids=(2, -1))], r"request 0 \('a'\): stop_token_ids must be >= 0"),
        ([req("a", temperature=math.nan)], "temperature must be a finite number >= 0"),
        ([req("a", temperature=math.inf)], "temperature must be a finite number >= 0"),
        ([req("a"), req("b", temperature=-math.inf)], r"request 1 \('b'\): temperature"),
        ([req("a", prompt=(1, -2))], "prompt ids must be ints >= 0"),
        ([req("a", prompt=(1, 8))], r"prompt ids \[8\] are outside the vocabulary"),
        ([req("a", max_new_tokens=15)], "lower max_new_tokens to at most 14"),
        ([req("a", seed=True)], "seed must be an int or None"),
    ],
)
def test_bad_requests_are_refused_naming_the_request(requests, match):
    with pytest.raises(ValueError, match=match):
        validate_requests(requests, max_seq_len=16, vocab_size=8)


def test_ids_may_repeat_across_calls_and_lengths_are_skipped_without_a_limit():
    validate_requests([req("a")], max_seq_len=None)
    validate_requests([req("a", max_new_tokens=10_000)], max_seq_len=None)
    with pytest.raises(TypeError, match="request 0 is a dict"):
        validate_requests([{"prompt_ids": [1]}], max_seq_len=None)


def test_group_counter_never_counts_a_group_with_a_request_that_cannot_complete_it():
    def grouped(rid, group, completes=True):
        return GenerateRequest([1], request_id=rid, group=group, completes_group=completes)

    reqs = [grouped("a0", "a", completes=False), grouped("a1", "a"), grouped("b2", "b")]
    reqs.append(GenerateRequest([1], request_id="c3"))  # a group of its own
    counter = GroupCounter(reqs, until_groups=2)
    assert not counter.finish(1) and not counter.finish(0)  # group a: finished, not counted
    assert counter.complete == 0
    assert not counter.finish(3)  # c
    assert counter.finish(2)  # b: the second counted group
    everyone = GroupCounter([replace(r, completes_group=True) for r in reqs], until_groups=1)
    assert not everyone.finish(1) and everyone.finish(0)  # the default: a counts
