"""``compile: true`` (minippo.parallel.compile_blocks): each decoder block runs compiled, names and
state_dict keys unchanged, and the training forward/backward equals the eager model's up to fp32
rounding. The checks that compile are marked slow (tens of seconds on a loaded 2-core machine);
the contract checks are not."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo

from minippo import parallel
from minippo.models import (
    ModelArgs,
    Transformer,
    ValueModel,
    init_weights,
    pack,
    qwen3_tiny,
    token_logprobs_and_entropy,
)
from minippo.parallel.compile import compilation_count, is_compiled


def _tiny() -> Transformer:
    return init_weights(Transformer(qwen3_tiny()), seed=0)


def test_every_block_is_compiled_and_the_names_stay():
    model = _tiny()
    keys = list(model.state_dict())
    assert parallel.compile_blocks(model) is model
    assert all(is_compiled(b) for b in model.layers)
    assert not is_compiled(model) and not is_compiled(model.norm)
    assert list(model.state_dict()) == keys  # no _orig_mod prefix: checkpoints and HF export
    critic = parallel.compile_blocks(ValueModel(qwen3_tiny()))
    assert all(is_compiled(b) for b in critic.layers)


def test_twice_or_without_blocks_is_refused():
    model = parallel.compile_blocks(_tiny())
    with pytest.raises(RuntimeError, match="already compiled"):
        parallel.compile_blocks(model)
    with pytest.raises(TypeError, match=r"non-empty nn\.ModuleList \.layers"):
        parallel.compile_blocks(torch.nn.Linear(2, 2))


def _passes(models, rows: int, length: int, *, packed: bool, grad: bool) -> None:
    """A forward of each model on left-padded rows (prompts of 1..4 tokens, responses of 1..
    length-4), padded or packed; with ``grad``, a backward too (the training pass), else under
    no_grad (the scoring passes: old logprobs, reference, values)."""
    ids = torch.randint(0, 50, (rows, length), generator=torch.Generator().manual_seed(rows))
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for r in range(rows):
        mask[r, 4 - (1 + r % 4) : 4 + 1 + (r * 3) % (length - 4)] = True
    kw = dict(position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0) * mask)
    kw.update(packed=pack(mask, start=4)) if packed else kw.update(attention_mask=mask)
    for model in models:
        with torch.set_grad_enabled(grad):
            out = model(ids, **kw)
        if grad:
            out.float().sum().backward()


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    # aot_eager: Dynamo's graphs and guards (so its recompiles) and AOTAutograd, no codegen
    return parallel.compile_blocks(model, backend="aot_eager")


def _count(run) -> dict[str, int]:
    """compilation_count() differences over ``run()``; a recompile limit hit raises."""
    before = compilation_count()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        run()
    after = compilation_count()
    return {k: after[k] - before[k] for k in after}


def _depth(n_layers: int) -> ModelArgs:
    return dataclasses.replace(qwen3_tiny(), n_layers=n_layers)


def test_every_block_after_the_first_reuses_its_graphs():
    """torch.compile caches graphs per code object: the blocks of all models share
    TransformerBlock.forward's cache, at most recompile_limit (8) entries, past which blocks run
    eagerly. Any per-layer Python state the traced block reads (an int layer index is a
    constant to the compiler) makes one graph per block. So with the graphs of block 0 compiled,
    a 12-layer forward (more than 8 blocks) compiles nothing, and nothing falls back to eager.
    The packed no-grad pass: its graph break (the eager bucketed attention) reads every local of
    the block."""
    torch._dynamo.reset()  # empty caches, whatever this process compiled before
    model = _compiled(init_weights(Transformer(_depth(12)), seed=0))
    blocks = model.layers
    model.layers = torch.nn.ModuleList(blocks[:1])
    first = _count(lambda: _passes([model], 4, 9, packed=True, grad=False))
    assert first["graphs"] > 0 and first["eager_frames"] == 0  # the counters are read
    model.layers = blocks
    assert _count(lambda: _passes([model], 4, 9, packed=True, grad=False)) == {
        "graphs": 0,
        "frames": 0,
        "eager_frames": 0,
    }


@pytest.mark.slow
def test_compiled_graphs_are_one_per_grad_mode_path_and_block_kind():
    """What counts, over every pass of a PPO step: the grad mode (training / no-grad scoring) and
    the attention path (padded / packed) compile once each; an actor, a reference and a critic of
    one size share those graphs; more batch sizes and lengths (dynamic from the first call) and
    more layers compile nothing more; a critic of another width compiles the same set again
    (its blocks' weight shapes differ); no cache goes past its limit."""
    torch._dynamo.reset()
    args = _depth(12)
    models = [
        _compiled(init_weights(Transformer(args), seed=0)),
        _compiled(init_weights(Transformer(args), seed=1)),
        _compiled(init_weights(ValueModel(args), seed=2)),
    ]
    variants = [dict(packed=p, grad=g) for p in (False, True) for g in (True, False)]
    first = _count(lambda: [_passes(models[:1], 4, 9, **v) for v in variants])
    assert first["graphs"] > 0 and first["eager_frames"] == 0
    again = _count(
        lambda: [_passes(models, r, n, **v) for r, n in ((4, 9), (3, 11)) for v in variants]
    )
    assert again == {"graphs": 0, "frames": 0, "eager_frames": 0}
    wide = _compiled(init_weights(ValueModel(dataclasses.replace(args, dim=32)), seed=3))
    # 2 grad modes x 2 paths x 2 block kinds = 8 entries on TransformerBlock.forward: the limit.
    # (Frames that compile no graph of their own, e.g. the packed attention's dispatch, are
    # reused: only the graphs double.)
    second = _count(lambda: [_passes([wide], 4, 9, **v) for v in variants])
    assert second["graphs"] == first["graphs"] and second["eager_frames"] == 0


def test_the_config_key_is_checked():
    from minippo.training.preflight import ASYNC_PPO_SCHEMA

    assert "compile" in ASYNC_PPO_SCHEMA


# fp32: inductor fuses each block's element-wise ops and reductions (RMSNorm, softmax in
# attention, SiLU·mul) and may sum in another order. Each reordered sum of n ≤ 128 terms moves
# by at most ~n·2^-24 ≈ 8e-6 of its magnitude; two blocks, forward and backward, compound a
# few of those: 1e-4 of the largest magnitude bounds them with room, and is still 100x below
# the size of a real change (one Adam step at lr 1e-3 moves logits by ~1e-2).
REL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_forward_and_backward_equal_the_eager_ones(packed):
    """Also packed (ppo.pack: the bucketed attention runs eagerly between the compiled parts of
    each block), on rows of several lengths."""
    torch._dynamo.reset()  # the recompile limit counts what this process compiled before
    torch.manual_seed(0)
    eager = _tiny()
    compiled = parallel.compile_blocks(copy.deepcopy(eager))
    fallbacks = compilation_count()["eager_frames"]
    for rows, length in ((16, 10), (8, 13), (8, 12)):  # more shapes: the dynamic recompile
        ids = torch.randint(0, 50, (rows, length))
        kw = {}
        if packed:  # left-padded prompts of 1..6 tokens, right-padded responses of 0..length-6
            mask = torch.zeros(rows, length, dtype=torch.bool)
            for r in range(rows):
                mask[r, 6 - (1 + r % 6) : 6 + (r * 5) % (length - 5)] = True
            kw = dict(position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0) * mask)
            kw["packed"] = pack(mask, start=6)
        out = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            model.zero_grad(set_to_none=True)
            lp, ent = token_logprobs_and_entropy(model, ids, start=6, **kw)
            (lp.sum() + 0.01 * ent.sum()).backward()
            with torch.no_grad():  # the scoring passes (anchors, critic values)
                lp_ng, _ = token_logprobs_and_entropy(model, ids, start=6, **kw)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[name] = (lp.detach(), ent.detach(), lp_ng, grads)
        (lp_e, ent_e, ng_e, g_e), (lp_c, ent_c, ng_c, g_c) = out["eager"], out["compiled"]
        for a, b in ((lp_c, lp_e), (ent_c, ent_e), (ng_c, ng_e)):
            assert (a - b).abs().max() <= REL * b.abs().max()
        for n, g in g_e.items():
            assert (g_c[n] - g).abs().max() <= REL * g.abs().max(), n
    assert compilation_count()["eager_frames"] == fallbacks  # every pass ran compiled
