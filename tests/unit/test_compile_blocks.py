"""``compile: true`` (minippo.parallel.compile_blocks): each decoder block runs compiled, names and
state_dict keys unchanged, and the training forward/backward equals the eager model's up to fp32
rounding. The checks that compile are marked slow (tens of seconds on a loaded 2-core machine);
the contract checks are not."""

from __future__ import annotations

import copy

import pytest
import torch

from minippo import parallel
from minippo.models import (
    Transformer,
    ValueModel,
    init_weights,
    pack,
    qwen3_tiny,
    token_logprobs_and_entropy,
)
from minippo.parallel.compile import is_compiled


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
    torch.manual_seed(0)
    eager = _tiny()
    compiled = parallel.compile_blocks(copy.deepcopy(eager))
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
