"""Whole groups move between two gloo ranks so that each trains on nearly as many tokens
(``ppo.balance_ranks``, minippo.training.rank_balance), and the step trains as without the move.

The batch: tests.helpers' 8 fixed rollouts (real tokens 11, 7, 11, 6, 7, 11, 4, 11) reordered
into 4 groups of 2 so that rank 0 samples the two heaviest: rank 0 rows (0, 2), (5, 7) = 22 + 22
tokens, rank 1 rows (1, 3), (4, 6) = 13 + 11. Balanced, rank 0 keeps (0, 2) and takes (1, 3)
(35 tokens), rank 1 keeps (5, 7) and (4, 6) (33).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minippo.config import load_config
from tests.distributed.test_one_vs_two_ranks import _copy, _live_weights
from tests.distributed.test_packed_equals_padded import (
    PACKED,
    _chain_and_logits,
    _max_excess,
)
from tests.helpers import (
    FIXED_BATCH_OVERRIDES,
    fixed_rollout_batch,
    recipe_on_fixed_batches,
    run_on_ranks,
    shared_process_group,
)

ORDER = [0, 2, 5, 7, 1, 3, 4, 6]  # rows of the fixed batch: rank 0 gets the first four
GROUPS = [(0, 2), (5, 7), (1, 3), (4, 6)]  # in fixed-batch rows


def heavy_first(args):
    """The fixed batch reordered (ORDER), groups of 2 in that order."""
    batch = fixed_rollout_batch(args).select(torch.tensor(ORDER))
    batch.group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    return batch


def _trimmed(batch):
    """The batch without the prompt and response columns that are padding in every row."""
    real = batch.attention_mask.any(0)
    P = batch.prompt_len
    first = int(real[:P].long().argmax())
    last = P + int(real[P:].nonzero().max()) + 1
    out = batch.select(slice(None))
    for name in ("input_ids", "attention_mask", "position_ids"):
        setattr(out, name, getattr(batch, name)[:, first:last])
    for name in ("response_mask", "rollout_logprobs", "versions"):
        setattr(out, name, getattr(batch, name)[:, : last - P])
    return out


def _exchange(rank: int, world: int, out: str) -> None:
    from minippo.models import qwen3_tiny
    from minippo.parallel import init_distributed
    from minippo.training.rank_balance import balance_over_ranks

    init_distributed()
    mine = heavy_first(qwen3_tiny(vocab_size=51)).select(slice(4 * rank, 4 * rank + 4))
    if rank == 1:  # narrower than rank 0's: P 5, R 4
        mine = _trimmed(mine)
        assert (mine.prompt_len, mine.response_mask.shape[1]) == (5, 4)
    got, metrics = balance_over_ranks(mine, "cpu")
    torch.save({"batch": got, "metrics": metrics}, Path(out) / f"rank{rank}.pt")


def _fingerprint(batch, row: int) -> tuple:
    """A row's content without its padding."""
    real, resp = batch.attention_mask[row], batch.response_mask[row] > 0
    return (
        tuple(batch.input_ids[row][real].tolist()),
        tuple(batch.position_ids[row][real].tolist()),
        tuple(batch.rollout_logprobs[row][resp].tolist()),
        tuple(batch.versions[row][resp].tolist()),
        float(batch.rewards[row]),
        bool(batch.truncated[row]),
    )


def test_groups_move_whole_to_even_the_ranks_tokens(tmp_path):
    from minippo.models import qwen3_tiny

    run_on_ranks(_exchange, str(tmp_path))
    full = fixed_rollout_batch(qwen3_tiny(vocab_size=51))
    want = [[GROUPS[0], GROUPS[2]], [GROUPS[1], GROUPS[3]]]
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        got, metrics = saved["batch"], saved["metrics"]
        # the widest prompt and response of either rank
        assert (got.prompt_len, got.response_mask.shape[1]) == (6, 5)
        rows = [r for group in want[rank] for r in group]
        assert [_fingerprint(got, i) for i in range(4)] == [_fingerprint(full, r) for r in rows]
        assert got.group_ids.tolist() == [0, 0, 1, 1]  # renumbered, whole groups
        assert int(got.attention_mask.sum()) == (35, 33)[rank]
        assert metrics["perf/rank_tokens_max_over_mean_sampled"] == pytest.approx(44 / 34)
        assert metrics["perf/rank_tokens_max_over_mean"] == pytest.approx(35 / 34)


# ----------------------------------------------------------------------------------------------
# One recipe step: balanced on 2 ranks = unbalanced on 2 ranks = 1 process

CASES = {
    "grpo_tis": [  # group statistics: a split group would change the advantages
        "correction._component_=minippo.rl.correction.TIS", "~correction.reset_below",
        "advantage_estimator=grpo",
    ],
    "gae_ewma": [],
}  # fmt: skip
SHAPE = ["rollout.groups_per_batch=4", "rollout.samples_per_prompt=2", "ppo.max_grad_norm=1e9"]


def train_one_step(out: Path, case: str, balance: bool, rank: int, world: int) -> dict | None:
    from minippo.parallel import gather_full_state_dict
    from minippo.training.metrics import read_jsonl

    path = out / f"{case}-{balance}-{world}"
    overrides = [*FIXED_BATCH_OVERRIDES, *SHAPE, *PACKED, *CASES[case]]
    cfg = load_config(
        "tiny_cpu", [*overrides, f"output_dir={path}", f"ppo.balance_ranks={balance}"]
    )
    with recipe_on_fixed_batches(cfg, lambda step: batch, rank, world) as recipe:
        batch = heavy_first(recipe.actor.args)
        models = _live_weights(recipe, cfg.seed)
        before = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
        recipe.train()
        after = {k: _copy(gather_full_state_dict(m)) for k, m in models.items()}
    if rank != 0:
        return None
    (row,) = read_jsonl(path / "metrics.jsonl")
    return {"before": before, "after": after, "metrics": row}


def _ranks(rank: int, world: int, out: str) -> None:
    with shared_process_group():  # the cases in turn
        results = {
            (case, balance): train_one_step(Path(out), case, balance, rank, world)
            for case in CASES
            for balance in (True, False)
        }
        if rank == 0:
            torch.save(results, Path(out) / "two_ranks.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("balance")
    threads = torch.get_num_threads()
    try:
        one = {case: train_one_step(out, case, True, 0, 1) for case in CASES}
    finally:
        torch.set_num_threads(threads)  # the recipe sets cpu_threads
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    run_on_ranks(_ranks, str(out))
    return {"one": one, "two": torch.load(out / "two_ranks.pt", weights_only=False)}


@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "as-sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_balanced_step_trains_as_one_process(runs, case, balance):
    """The update of 2 ranks (groups moved or not) is the 1-process update within the rounding
    bound of tests/distributed/test_packed_equals_padded.py; a group split between ranks or a
    wrong share would move it by O(update)."""
    ref, got = runs["one"][case], runs["two"][(case, balance)]
    K, Z = _chain_and_logits()
    N = 8 * 11
    factor = 4 * N + 4 + 4 * K * (1 + Z)
    for model in ref["after"]:
        before = ref["before"][model]
        excess, tensor = _max_excess(before, ref["after"][model], got["after"][model], factor)
        assert excess <= 1.0, f"{model}.{tensor}: difference {excess:.3g} x the bound"
    m = got["metrics"]
    if balance:
        assert m["perf/rank_tokens_max_over_mean_sampled"] == pytest.approx(44 / 34)
        assert m["perf/rank_tokens_max_over_mean"] == pytest.approx(35 / 34)
    else:
        assert "perf/rank_tokens_max_over_mean" not in m
    assert "perf/rank_tokens_max_over_mean" not in runs["one"][case]["metrics"]
