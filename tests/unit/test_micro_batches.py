"""Token-budget micro-batches (minippo.training.micro_batches): the fewest groups within the
budget, spread longest first into the lightest group."""

from __future__ import annotations

import random

import pytest

from minippo.training.micro_batches import balance_tokens, micro_batch_count


def test_longest_first_into_the_lightest_group():
    # 9 → g0, 7 → g1, 6 → g2, 5 → g2 (6 is the lightest), 4 → g1 (7), 2 → g0 (9 vs 11, 11)
    assert balance_tokens([5, 9, 2, 7, 4, 6], 3) == [[1, 2], [3, 4], [0, 5]]
    # ties go to the lower group; groups list their indices in order
    assert balance_tokens([3, 3, 3, 3], 2) == [[0, 2], [1, 3]]
    assert balance_tokens([4], 2) == [[0], []]  # fewer sequences than groups


def test_count_is_the_fewest_groups_within_the_budget():
    assert micro_batch_count([5, 9, 2, 7, 4, 6], 33) == 1  # 33 tokens in one
    assert micro_batch_count([5, 9, 2, 7, 4, 6], 17) == 2  # [9, 5, 2] = 16, [7, 6, 4] = 17
    # ceil(33 / 12) = 3 groups give [9, 2], [7, 4], [6, 5] = 11 each
    assert micro_batch_count([5, 9, 2, 7, 4, 6], 12) == 3
    # 3 groups of [11, 7, 11, 6] are [11], [11], [7, 6] = 13 > 12: one more
    assert micro_batch_count([11, 7, 11, 6], 12) == 4
    # a sequence longer than the budget takes a group alone
    assert micro_batch_count([30, 2, 2], 10) == 2
    assert balance_tokens([30, 2, 2], 2) == [[0], [1, 2]]
    assert micro_batch_count([30, 40], 10) == 2


def test_random_lengths_keep_the_budget_and_balance():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(30, 300)
        k = micro_batch_count(lengths, budget)
        groups = balance_tokens(lengths, k)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert all(s <= budget or len(g) == 1 for s, g in zip(sums, groups))
        assert k == 1 or not all(  # one group fewer breaks the budget
            len(g) <= 1 or sum(lengths[i] for i in g) <= budget
            for g in balance_tokens(lengths, k - 1)
        )
        # LPT: the heaviest group exceeds the lightest by at most the longest sequence in it
        assert max(sums) - min(sums) <= max(lengths)


def test_bad_arguments():
    with pytest.raises(ValueError, match="count"):
        balance_tokens([1], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batch_count([1], 0)


def test_split_rows_by_rows_by_tokens_or_whole():
    import torch

    from minippo.training.micro_batches import split_rows

    lengths = torch.tensor([11, 7, 11, 6, 7, 11, 4, 11])
    sets = [torch.tensor([0, 1, 2, 3]), torch.tensor([7, 6, 5, 4])]
    by_rows = split_rows(sets, lengths, max_tokens=None, max_rows=2, device="cpu")
    assert [[g.tolist() for g in s] for s in by_rows] == [[[0, 1], [2, 3]], [[7, 6], [5, 4]]]
    whole = split_rows(sets, lengths, max_tokens=None, max_rows=None, device="cpu")
    assert [[g.tolist() for g in s] for s in whole] == [[[0, 1, 2, 3]], [[7, 6, 5, 4]]]
    # 12 tokens: [11, 7, 11, 6] needs 4 forwards ([7, 6] = 13 > 12), [11, 4, 11, 7] needs 3
    by_tokens = split_rows(sets, lengths, max_tokens=12, max_rows=None, device="cpu")
    assert [[g.tolist() for g in s] for s in by_tokens] == [
        [[0], [2], [1], [3]],
        [[7], [5], [6, 4]],
    ]


def _host_mask(prompt: int, lengths: list[int]):
    """Bool[B, prompt + max(lengths)]: a left-padded prompt of 2 tokens, then each response."""
    import torch

    mask = torch.zeros(len(lengths), prompt + max(lengths), dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, prompt - 2 : prompt + n] = True
    return mask


def test_update_plan_covers_every_row_once_per_epoch_with_its_layout():
    import torch

    from minippo.models import pack
    from minippo.training.micro_batches import update_plan

    mask = _host_mask(3, [5, 1, 4, 2, 3, 5])  # real tokens 7, 3, 6, 4, 5, 7
    kw = dict(epochs=2, minibatches=2, max_tokens=None, max_rows=2, pack_start=3, device="cpu")
    plan = update_plan(mask, torch.Generator().manual_seed(7), **kw)
    assert len(plan) == 4  # epochs x minibatches optimizer steps
    for epoch in (plan[:2], plan[2:]):  # each epoch's minibatches cover every row once
        rows = torch.cat([r for micros in epoch for r, _ in micros])
        assert sorted(rows.tolist()) == list(range(6))
    for micros in plan:
        assert [len(r) for r, _ in micros] == [2, 1]  # 3 rows per minibatch, 2 per forward
        for rows, layout in micros:  # the layout packs those rows' real tokens, on the host
            want = pack(mask[rows], start=3)
            assert layout.rows.device.type == "cpu" and layout.seq_lens == want.seq_lens
            assert torch.equal(layout.rows, want.rows) and torch.equal(layout.cols, want.cols)
    # the same generator state gives the same plan (a resumed run shuffles the same way); padded
    again = update_plan(mask, torch.Generator().manual_seed(7), **{**kw, "pack_start": None})
    assert [[r.tolist() for r, _ in m] for m in again] == [[r.tolist() for r, _ in m] for m in plan]
    assert all(layout is None for micros in again for _, layout in micros)


def test_scored_in_forwards_returns_the_rows_in_their_order():
    import torch

    from minippo.rl.types import RolloutBatch
    from minippo.training.micro_batches import scored_in_forwards

    lengths = [5, 1, 4, 2, 3, 5]
    mask = _host_mask(3, lengths)
    B, S = mask.shape
    batch = RolloutBatch(
        input_ids=torch.arange(B)[:, None].expand(B, S).clone(),  # each row holds its index
        attention_mask=mask,
        position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0),
        response_mask=mask[:, 3:].float(),
        rollout_logprobs=torch.zeros(B, S - 3),
        versions=torch.zeros(B, S - 3, dtype=torch.long),
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    layouts = []

    def fn(chunk, layout):  # the rows' own indices, as a scoring pass returns one value per row
        layouts.append(layout)
        return chunk.input_ids[:, 0].float()

    # a budget of 12 tokens regroups the rows (longest first): the output is back in row order
    out = scored_in_forwards(fn, batch, max_tokens=12, max_rows=None, pack=True, device="cpu")
    assert out.tolist() == list(range(B)) and len(layouts) > 1
    assert all(layout is not None for layout in layouts)
    layouts.clear()
    out = scored_in_forwards(fn, batch, max_tokens=None, max_rows=4, pack=False, device="cpu")
    assert out.tolist() == list(range(B)) and layouts == [None, None]
