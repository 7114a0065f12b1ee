"""Optimizer state from setup under FSDP2 on 2 gloo ranks: with DTensor parameters (bf16 compute,
as the recipe shards the actor) the state built by ``build_optimizer`` trains to the same local
shards and states, bit for bit, as a lazily created one (torch AdamW, torchao AdamW8bit)."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from minippo.config import instantiate
from minippo.models import Transformer, init_weights, qwen3_tiny
from minippo.parallel import destroy_distributed, init_distributed, shard_model
from minippo.training.optimizers import build_optimizer
from tests.unit.test_optimizer_eager_state import assert_bitwise, state_tensors

COMPONENTS = ["minippo.training.optimizers.AdamW", "torchao.optim.AdamW8bit"]


def _worker(rank: int, world_size: int, out: str) -> None:
    import torch.nn.functional as F

    init_distributed()
    try:
        for comp in COMPONENTS:
            node = OmegaConf.create({"_component_": comp, "lr": 1e-2, "weight_decay": 0.1})
            runs = []
            for eager in (True, False):
                model = init_weights(Transformer(qwen3_tiny()), seed=0)
                shard_model(model, param_dtype=torch.bfloat16, sum_gradients=True)
                build = build_optimizer if eager else instantiate
                with torch.compiler.set_stance("force_eager"):
                    opt = build(node, model.parameters())
                    assert bool(opt.state) is eager
                    for i in range(3):
                        g = torch.Generator().manual_seed(10 * i + rank)
                        tokens = torch.randint(0, 64, (2, 13), generator=g)
                        logits = model(tokens[:, :-1])
                        F.cross_entropy(
                            logits.reshape(-1, logits.shape[-1]).float(),
                            tokens[:, 1:].reshape(-1),
                        ).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                shards = [p.to_local() for p in model.parameters()]
                runs.append((shards, state_tensors(opt)))
            (p_eager, s_eager), (p_lazy, s_lazy) = runs
            assert_bitwise(p_eager, p_lazy)
            assert_bitwise(s_eager, s_lazy)
        open(os.path.join(out, f"ok{rank}"), "w").close()
    finally:
        destroy_distributed()


@pytest.mark.slow  # ~40 s on a loaded 2-core box: two spawned ranks, torchao's eager step
def test_eager_state_trains_fsdp2_shards_bit_for_bit_as_lazy(run_on_ranks, tmp_path):
    run_on_ranks(_worker, str(tmp_path), world_size=2)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
