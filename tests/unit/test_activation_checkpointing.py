"""Activation checkpointing per block: same names, same gradients, fewer saved activations."""

import copy

import pytest
import torch

from benchmarks._common import TensorMemoryTracker
from minippo.models import Transformer, ValueModel, init_weights, qwen3_tiny, token_logprobs
from minippo.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    is_activation_checkpointed,
)
from tests.helpers import run_on_ranks, saved_bytes

B, S, P = 2, 32, 8


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :3] = False  # a left-padded prompt
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return tokens, mask, positions


def _loss(model, tokens, mask, positions):
    """The training forward of the actor (chunked logprobs) or the critic (values)."""
    if isinstance(model, ValueModel):
        v = model(tokens, position_ids=positions, attention_mask=mask)
        return (v[:, P:] ** 2).mean()
    lp = token_logprobs(
        model, tokens, attention_mask=mask, position_ids=positions, start=P, chunk_size=16
    )
    return -(lp * torch.linspace(-1, 1, S - P)).mean()


def _models(cls):
    torch.manual_seed(0)
    base = init_weights(cls(qwen3_tiny()), seed=1)
    return base, apply_activation_checkpointing(copy.deepcopy(base))


@pytest.mark.parametrize("cls", [Transformer, ValueModel])
def test_names_and_state_dict_keys_unchanged(cls):
    base, ac = _models(cls)
    assert list(ac.state_dict()) == list(base.state_dict())
    assert [n for n, _ in ac.named_parameters()] == [n for n, _ in base.named_parameters()]
    assert [n for n, _ in ac.named_modules()] == [n for n, _ in base.named_modules()]
    assert all(is_activation_checkpointed(b) for b in ac.layers)
    assert not any(is_activation_checkpointed(b) for b in base.layers)


@pytest.mark.parametrize("cls", [Transformer, ValueModel])
def test_gradients_identical_to_no_checkpointing(cls):
    base, ac = _models(cls)
    batch = _batch()
    loss_base, loss_ac = _loss(base, *batch), _loss(ac, *batch)
    loss_base.backward()
    loss_ac.backward()
    assert loss_ac.item() == loss_base.item()
    for (name, p), q in zip(base.named_parameters(), ac.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0, msg=name)


def test_saved_activation_bytes_and_live_peak_are_lower():
    base, ac = _models(Transformer)
    batch = _batch()
    saved_base, loss_base = saved_bytes(base, lambda: _loss(base, *batch))
    saved_ac, loss_ac = saved_bytes(ac, lambda: _loss(ac, *batch))
    # every block's internals are recomputed; only embeddings/final norm remain saved
    assert saved_ac < saved_base / 4, (saved_ac, saved_base)
    loss_base.backward()
    loss_ac.backward()

    def live_peak(model):
        tracker = TensorMemoryTracker().track(model)
        with tracker:
            _loss(model, *batch).backward()
        return tracker.peak["cpu"]

    assert live_peak(ac) < live_peak(base)


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match="layers"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
    _, ac = _models(Transformer)
    with pytest.raises(RuntimeError, match="called twice"):
        apply_activation_checkpointing(ac)


def test_no_grad_forward_unchanged_and_deepcopy_keeps_checkpointing():
    base, ac = _models(Transformer)
    tokens, mask, positions = _batch()
    with torch.no_grad():
        torch.testing.assert_close(
            ac(tokens, attention_mask=mask, position_ids=positions),
            base(tokens, attention_mask=mask, position_ids=positions),
            atol=0,
            rtol=0,
        )
    twin = copy.deepcopy(ac)
    assert all(is_activation_checkpointed(b) for b in twin.layers)
    _loss(twin, tokens, mask, positions).backward()
    assert all(p.grad is None for p in ac.parameters())
    assert all(p.grad is not None for p in twin.parameters())


# ---------------------------------------------------------------- with FSDP2 (2 gloo ranks)


def _fsdp_worker(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    from minippo.parallel import shard_model

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        base, ac = _models(Transformer)
        names = [n for n, _ in base.named_parameters()]
        shard_model(base)
        shard_model(ac)  # checkpointing applied before sharding, as the recipe must
        assert [n for n, _ in ac.named_parameters()] == names
        assert list(ac.state_dict()) == list(base.state_dict())
        batch = _batch()
        _loss(base, *batch).backward()
        _loss(ac, *batch).backward()
        diffs = [
            (q.grad.full_tensor() - p.grad.full_tensor()).abs().max().item()
            for p, q in zip(base.parameters(), ac.parameters())
        ]
        if rank == 0:
            torch.save(max(diffs), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_composes_with_fsdp2_sharding(tmp_path):
    out = str(tmp_path / "max_diff.pt")
    run_on_ranks(_fsdp_worker, out, world_size=2)
    assert torch.load(out) <= 1e-6
