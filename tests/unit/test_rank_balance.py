"""Moving whole groups between ranks (minippo.training.rank_balance.assign_groups) and re-padding
a batch (RolloutBatch.padded_to); the exchange itself runs on two ranks in
tests/distributed/test_rank_balance.py."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from minippo.rl.types import RolloutBatch
from minippo.training.rank_balance import assign_groups
from tests.helpers import fixed_rollout_batch


def test_heaviest_group_first_into_the_lightest_rank_with_room():
    # 9 → r0, 8 → r1, 5 → r1 (8 < 9), 4 → r0 (9 < 13); both full
    assert assign_groups([5, 9, 4, 8], [2, 2]) == [[1, 2], [0, 3]]
    # ties go to the lower rank; a full rank takes no more even when lighter
    assert assign_groups([3, 3, 3, 3], [2, 2]) == [[0, 2], [1, 3]]
    assert assign_groups([10, 1, 1, 1], [1, 3]) == [[0], [1, 2, 3]]
    assert assign_groups([], [0, 0]) == [[], []]


def test_every_group_once_each_rank_its_count_and_near_even():
    rng = random.Random(0)
    for _ in range(300):
        ranks = rng.randint(2, 8)
        per_rank = rng.randint(1, 12)
        tokens = [int(rng.lognormvariate(5, 1)) for _ in range(ranks * per_rank)]
        out = assign_groups(tokens, [per_rank] * ranks)
        assert sorted(i for g in out for i in g) == list(range(len(tokens)))
        assert all(len(g) == per_rank for g in out)
        loads = [sum(tokens[i] for i in g) for g in out]
        # the last group into a rank went there while it was the lightest with room, so no rank
        # exceeds another by more than the largest group
        assert max(loads) - min(loads) <= max(tokens)
        # never heavier than the ranks as sampled (consecutive groups)
        sampled = [sum(tokens[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]
        assert max(loads) <= max(sampled)


def test_bad_capacity():
    with pytest.raises(ValueError, match="add up"):
        assign_groups([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        assign_groups([1, 2], [3, -1])


def test_padded_to_keeps_every_row_and_pads_as_collated():
    batch = fixed_rollout_batch(_args())  # P = 6, R = 5
    wide = batch.padded_to(9, 7)
    assert (wide.prompt_len, wide.response_mask.shape[1]) == (9, 7)
    real = batch.attention_mask
    assert torch.equal(wide.input_ids[wide.attention_mask], batch.input_ids[real])
    assert torch.equal(wide.position_ids[wide.attention_mask], batch.position_ids[real])
    assert torch.equal(wide.attention_mask[:, 3:14], real) and not wide.attention_mask[:, :3].any()
    assert not wide.attention_mask[:, 14:].any()
    for name, pad in (("response_mask", 0.0), ("rollout_logprobs", 0.0), ("versions", -1)):
        t = getattr(wide, name)
        assert torch.equal(t[:, :5], getattr(batch, name)) and (t[:, 5:] == pad).all(), name
    for name in ("rewards", "group_ids", "truncated"):
        assert torch.equal(getattr(wide, name), getattr(batch, name))
    # every per-token field takes the new widths (a new one must be added to padded_to)
    for f in fields(RolloutBatch):
        t = getattr(wide, f.name)
        assert t.dtype == getattr(batch, f.name).dtype, f.name
        assert t.dim() == 1 or t.shape[1] in (9 + 7, 7), (f.name, tuple(t.shape))
    same = batch.padded_to(6, 5)
    assert all(torch.equal(getattr(same, f.name), getattr(batch, f.name)) for f in fields(same))
    with pytest.raises(ValueError, match="narrower"):
        batch.padded_to(5, 5)


def _args():
    from minippo.models import qwen3_tiny

    return qwen3_tiny(vocab_size=51)
