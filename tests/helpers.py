"""Small helpers shared by test modules (imported as ``tests.helpers``): free ports and gloo ranks
for multi-process tests, the CLI in the test's process, bytes autograd saves for backward, the
recipe driven with fixed rollouts, and the unfused reference of the recipe's actor micro-step."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT / --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minippo_here(*args: str) -> subprocess.CompletedProcess:
    """``minippo <args>`` in this process, for a command that ends before any recipe runs
    (``validate``, a refused ``run``): the console entry's code without a process of its own,
    which spends seconds importing torch. ``(returncode, stdout, stderr)`` as from
    ``subprocess.run``; the launch time a ``run`` records (``${now}``) is undone. The process
    itself (one line, no traceback, exit code): tests/recipes/test_bad_inputs.py."""
    from minippo._cli.main import main
    from minippo.config._parse import RUN_TIME_ENV

    before = os.environ.get(RUN_TIME_ENV)
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        if before is None:
            os.environ.pop(RUN_TIME_ENV, None)
        else:
            os.environ[RUN_TIME_ENV] = before
    return subprocess.CompletedProcess(["minippo", *args], code, out.getvalue(), err.getvalue())


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    # the same environment torchrun provides, so code under test can call init_distributed()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    fn(rank, world_size, *args)
    # Done, and every check passed. Leave without running C++ static destructors: on a loaded
    # machine torch's gloo teardown can abort the process at exit ("terminate called without an
    # active exception", SIGABRT) after the test's work is complete, failing a passed test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def shared_process_group() -> Iterator[None]:
    """In a rank of ``run_on_ranks``: one process group for several recipe runs in turn (the
    recipe's cleanup, which ends the group, leaves it open), ended on exit."""
    import minippo.parallel as parallel

    destroy, parallel.destroy_distributed = parallel.destroy_distributed, lambda: None
    parallel.init_distributed()
    try:
        yield
    finally:
        destroy()


def run_on_ranks(fn: Callable, *args: Any, world_size: int = 2) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with torchrun's
    environment variables set (a free port per call); an exception on any rank raises here.
    ``fn`` must be a module-level function (it is pickled by name)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def saved_bytes(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[int, Any]:
    """``(bytes, fn())``: the bytes of the distinct storages that autograd saves for backward
    (outside checkpointed regions; parameters excluded) while ``fn`` runs the forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


# ----------------------------------------------------------------------------------------------
# Driving the recipe with fixed rollouts (tests/distributed/test_one_vs_two_ranks.py,
# tests/recipes/test_recipe_properties.py)

REPO = Path(__file__).resolve().parents[1]
_C = "correction._component_=minippo.rl.correction."
# overrides that switch a config shipped with EWMA (tiny_cpu and the other CPU configs) to each
# correction, keyed by class name: the options of EWMA that the others do not take are removed
SWITCH_CORRECTION: dict[str, list[str]] = {
    "EWMA": [],
    "TIS": [_C + "TIS", "~correction.reset_below"],
    "KeepOldActor": [_C + "KeepOldActor", "~correction.reset_below"],
    "LogLinearProx": [_C + "LogLinearProx", "~correction.reset_below"],
    "RolloutLogprobs": [_C + "RolloutLogprobs", "~correction.cap", "~correction.reset_below"],
}
# tiny_cpu, shrunk for one-step comparisons: 2 prompts x 4 samples, one minibatch per epoch
# (so that 1 and 2 ranks take the same optimizer step on the same rows), micro-batches and scoring
# chunks of 4 rows (the per-row forward has the same shape on 1 and on 2 ranks), SGD (an update
# proportional to the gradient), one trainer thread, the engine in a thread.
FIXED_BATCH_OVERRIDES = [
    "total_steps=1",
    "rollout.groups_per_batch=2",
    "rollout.samples_per_prompt=4",
    "ppo.epochs=1",
    "ppo.minibatches=1",
    "ppo.micro_batch_size=4",
    "ppo.score_micro_batch_size=4",
    "optimizer._component_=torch.optim.SGD",
    "~optimizer.betas",
    "optimizer.lr=0.1",
    "critic.optimizer._component_=torch.optim.SGD",
    "~critic.optimizer.weight_decay",
    "critic.optimizer.lr=0.1",
    "lr_scheduler.min_lr_ratio=1.0",
    "ppo.max_update_kl=null",  # every update as taken (tests/recipes/test_update_bound.py: the bound)
    "cpu_threads=1",
    "engine.in_process=true",
    "progress_bar=false",
    "checkpoint.export_hf=false",
]


def recipe_globals() -> dict[str, Any]:
    """The recipe script's module globals (``AsyncPPORecipe``, ``recipe_main``, ...), loaded with
    runpy as ``minippo run`` does (nothing imports the recipe)."""
    import runpy

    return runpy.run_path(str(REPO / "recipes" / "async_ppo.py"))


def fixed_rollout_batch(args: Any, *, seed: int = 0, actor_seed: int = 0, mu_noise: float = 0.3):
    """8 rollouts (2 prompts x 4 samples) of the tiny task's shape, the same in every process.

    Prompts are left-padded (lengths 2..6), responses right-padded (lengths 1..5, some cut at the
    maximum: ``truncated``). μ (``rollout_logprobs``) is the logprob of each token under the
    recipe's initial actor (``init_weights(seed=actor_seed)``) plus seeded Gaussian noise of
    std ``mu_noise``, so that importance weights differ from 1 and some tokens leave the
    correction's mask. Rewards are seeded uniforms; versions 0.
    """
    from minippo.models import Transformer, init_weights, response_logprobs
    from minippo.rl.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    B, P, R = 8, 6, 5
    prompt_len = [6, 4, 6, 5, 3, 6, 2, 6]
    resp_len = [5, 3, 5, 1, 4, 5, 2, 5]
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.bool)
    for b in range(B):
        ids[b, P - prompt_len[b] : P] = torch.randint(
            1, args.vocab_size, (prompt_len[b],), generator=g
        )
        ids[b, P : P + resp_len[b]] = torch.randint(1, args.vocab_size, (resp_len[b],), generator=g)
        attn[b, P - prompt_len[b] : P + resp_len[b]] = True
    mask = attn[:, P:].float()
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        position_ids=(attn.long().cumsum(-1) - 1).clamp(min=0),
        response_mask=mask,
        rollout_logprobs=torch.zeros(B, R),
        versions=torch.where(mask > 0, 0, -1),
        rewards=torch.rand(B, generator=g),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        truncated=torch.tensor([n == R for n in resp_len]),
    )
    actor = init_weights(Transformer(args), seed=actor_seed)
    with torch.no_grad():
        lp = response_logprobs(actor, batch, temperature=1.0)
    noise = mu_noise * torch.randn(B, R, generator=g)
    batch.rollout_logprobs = torch.where(mask > 0, lp + noise, 0.0)
    return batch


def rank_rows(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's share of a batch: consecutive rows (whole prompt groups for 2 groups of 4)."""
    n = batch.batch_size // world_size
    return batch.select(slice(rank * n, (rank + 1) * n))


@contextmanager
def recipe_on_fixed_batches(cfg: Any, batch_of_step: Callable[[int], Any], rank: int = 0,
                            world_size: int = 1) -> Iterator[Any]:  # fmt: skip
    """The recipe, set up, whose rollout queue hands it ``rank_rows(batch_of_step(step))``
    instead of the engine's rollouts; cleaned up on exit (``recipe.cleanup()``, which also ends
    the process group if there is one)."""
    from minippo.training.rollout_queue import QueueBatch

    recipe = recipe_globals()["AsyncPPORecipe"](cfg)
    try:
        recipe.setup(cfg)

        def get_batch(step: int, timeout: float | None = None) -> QueueBatch:
            return QueueBatch(step, rank_rows(batch_of_step(step), rank, world_size), [], {})

        recipe.queue.get_batch = get_batch
        yield recipe
    finally:
        recipe.cleanup()


def reference_actor_backward(recipe, mb, rows, corr, advantages, ref_logprobs, counts, layout):
    """The recipe's actor micro-step computed without the fused pass, the reference the tests
    compare ``models.fused_policy_loss`` with: the logprobs and entropies of
    ``models.token_logprobs_and_entropy`` (the lm_head in chunks recomputed in backward), the
    correction's anchors, weights and keep-mask for them (``corr.minibatch``), ``rl.policy_loss``
    (+ β·``rl.kl_loss`` with ``kl.mode: loss``), autograd's backward. Arguments and return value:
    those of ``AsyncPPORecipe._actor_backward`` (bound to ``recipe``)."""
    from minippo import models, rl

    ppo, kl_cfg, m = recipe.ppo, recipe.kl, mb.response_mask
    agg = dict(agg_mode=ppo.loss_agg_mode, global_tokens=counts.tokens, global_seqs=counts.seqs)
    logp, entropy = models.token_logprobs_and_entropy(
        recipe.actor,
        mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        temperature=recipe.temperature,
        start=mb.prompt_len,
        packed=layout,
    )
    c = corr.minibatch(rows.to(recipe.device), logp)
    loss, st = rl.policy_loss(
        logp,
        c.anchor_logprobs,
        advantages,
        m,
        eps_low=ppo.clip_low,
        eps_high=ppo.clip_high,
        dual_clip=ppo.dual_clip,
        weights=c.weights,
        keep_mask=c.keep_mask,
        **agg,
    )
    per_token = rl.as_metrics(st)
    shares = {"train/policy_loss": per_token.pop("train/policy_loss")}
    per_token["train/entropy"] = rl.masked_mean(entropy.detach(), m)
    if recipe.use_ref and kl_cfg.mode == "loss":
        kl, kst = rl.kl_loss(logp, ref_logprobs, m, kl_cfg.estimator, **agg)
        loss = loss + kl_cfg.coef * kl
        shares["train/kl_loss"] = kst.kl_loss
        per_token["train/kl_mean"] = kst.kl_mean
    loss.backward()
    shares["train/loss"] = loss.detach()
    return shares, per_token, logp.detach()


def use_reference_policy_loss(recipe: Any) -> None:
    """Make ``recipe`` (set up) train its actor with :func:`reference_actor_backward`."""
    from functools import partial

    recipe._actor_backward = partial(reference_actor_backward, recipe)
