"""Prompt examples, seeded streams and the built-in toy tasks."""

import itertools

import pytest

from minippo.data import PerPositionMatch, PromptDataset, PromptExample, PromptStream
from minippo.data.rewards import ExactMatch
from minippo.data.tasks import arithmetic_task, digit_task
from minippo.models import TinyTokenizer


def test_arithmetic_task_is_seeded_and_correct():
    tok = TinyTokenizer()
    a = arithmetic_task(tok, num_prompts=50, max_operand=12, ops="+-*", seed=3)
    b = arithmetic_task(tok, num_prompts=50, max_operand=12, ops="+-*", seed=3)
    c = arithmetic_task(tok, num_prompts=50, max_operand=12, ops="+-*", seed=4)
    assert [e.prompt for e in a] == [e.prompt for e in b] != [e.prompt for e in c]
    for ex in a:
        assert eval(ex.prompt[:-1]) == int(ex.answer)  # "12-7=" -> "5"
        assert ex.prompt_ids == (tok.bos_id, *tok.encode(ex.prompt))
    assert [e.index for e in a] == list(range(50))
    with pytest.raises(ValueError, match="ops must be"):
        arithmetic_task(tok, ops="/")


def test_digit_task_ops_and_alphabet():
    tok = TinyTokenizer()
    for op, fn in (("copy", lambda s: s), ("reverse", lambda s: s[::-1]), ("sort", sorted)):
        ds = digit_task(tok, op=op, length=4, alphabet="0123", num_prompts=20, seed=0)
        for ex in ds:
            s = ex.prompt[:-1]
            assert len(s) == 4 and set(s) <= set("0123") and ex.prompt.endswith("=")
            assert ex.answer == "".join(fn(s))
    ds = digit_task(tok, length=2, num_prompts=3, add_bos=False)
    assert ds[0].prompt_ids == tuple(tok.encode(ds[0].prompt))
    with pytest.raises(ValueError, match="op must be one of"):
        digit_task(tok, op="rotate")
    with pytest.raises(ValueError, match="alphabet"):
        digit_task(tok, alphabet="00")


def test_digit_task_min_length_varies_the_answer_length():
    tok = TinyTokenizer()
    fixed = digit_task(tok, length=6, alphabet="0123", num_prompts=50, seed=1)
    assert {len(ex.answer) for ex in fixed} == {6}
    # without min_length the prompt set is the one the argument's absence gives
    same = digit_task(tok, length=6, alphabet="0123", num_prompts=50, seed=1, min_length=None)
    assert [ex.prompt for ex in fixed] == [ex.prompt for ex in same]
    varied = digit_task(
        tok, op="reverse", length=6, alphabet="0123", num_prompts=400, seed=1, min_length=2
    )
    assert {len(ex.answer) for ex in varied} == {2, 3, 4, 5, 6}
    for ex in varied:
        assert ex.answer == ex.prompt[:-1][::-1]
    for bad in (0, 7):
        with pytest.raises(ValueError, match=r"min_length must be null or in 1\.\.length"):
            digit_task(tok, length=6, min_length=bad)


def test_toy_rewards():
    ex = PromptExample(0, (1,), "12=", "123")
    r = PerPositionMatch()
    assert r(ex, "123") == 1.0
    assert r(ex, "120") == pytest.approx(2 / 3)
    assert r(ex, "1234") == pytest.approx(3 / 4)  # an extra character costs a position
    assert r(ex, "1") == pytest.approx(1 / 3)
    assert r(ex, "") == 0.0
    assert ExactMatch()(ex, " 123 ") == 1.0 and ExactMatch()(ex, "12") == 0.0


def test_prompt_stream_is_seeded_reiterable_and_covers_epochs():
    ds = digit_task(TinyTokenizer(), num_prompts=10, seed=0)
    stream = PromptStream(ds, seed=7)
    first = [e.index for e in itertools.islice(stream, 25)]
    again = [e.index for e in itertools.islice(stream, 25)]
    assert first == again
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new order each epoch
    assert [e.index for e in PromptStream(ds, shuffle=False, max_epochs=1)] == list(range(10))
    other = [e.index for e in itertools.islice(PromptStream(ds, seed=8), 10)]
    assert other != first[:10]
    # two ranks deal out the single-process sequence round-robin
    r0 = [e.index for e in itertools.islice(PromptStream(ds, seed=7, rank=0, world_size=2), 12)]
    r1 = [e.index for e in itertools.islice(PromptStream(ds, seed=7, rank=1, world_size=2), 12)]
    assert r0 == first[0:24:2] and r1 == first[1:25:2]
    with pytest.raises(ValueError, match="rank"):
        PromptStream(ds, rank=2, world_size=2)


def test_prompt_dataset_validation():
    with pytest.raises(ValueError, match="is empty"):
        PromptDataset([])
    with pytest.raises(ValueError, match="index 3"):
        PromptDataset([PromptExample(3, (1,), "a", "b")])
    with pytest.raises(ValueError, match="empty prompt"):
        PromptDataset([PromptExample(0, (), "", "b")])


def test_stop_ids_are_eos_then_one_token_per_stop_string():
    from minippo.training.preflight import stop_ids

    tok = TinyTokenizer(extra_tokens=["\\boxed{", "}"])
    brace = tok.encode("}")
    assert len(brace) == 1
    assert stop_ids(tok, None, stop_at_eos=True) == tuple(tok.eos_ids)
    assert stop_ids(tok, None, stop_at_eos=False) == ()
    assert stop_ids(tok, ["}"], stop_at_eos=True) == (*tok.eos_ids, brace[0])
    assert stop_ids(tok, ["}", "}"], stop_at_eos=False) == (brace[0],)  # no duplicates
    with pytest.raises(ValueError, match="'12' encodes to 2 tokens"):
        stop_ids(tok, ["12"], stop_at_eos=True)
    for bad in ("}", 3, [3]):
        with pytest.raises(ValueError, match="must be null or a list of strings"):
            stop_ids(tok, bad, stop_at_eos=True)
    from omegaconf import OmegaConf

    assert stop_ids(tok, OmegaConf.create({"s": ["}"]}).s, stop_at_eos=False) == (brace[0],)
