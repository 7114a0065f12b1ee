"""Asynchronous PPO for LLMs on one node (manual: the AsyncPPORecipe docstring, docs/recipe.md).

    minippo run async_ppo --config tiny_cpu                         # CPU, under a minute
    minippo run --nproc-per-node 8 async_ppo --config qwen3_4b_dapo_math_8gpu
    python recipes/async_ppo.py --config configs/tiny_cpu.yaml total_steps=20

Copy it with ``minippo cp async_ppo my_ppo.py`` and edit; nothing imports this file."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.utils import clip_grad_norm_

from minippo.config import instantiate, locate
from minippo.data import PromptStream
from minippo.engine import SamplingParams
from minippo.models import (
    TOKENIZER_FILES,
    Transformer,
    ValueModel,
    from_pretrained,
    init_weights,
    response_logprobs,
    save_pretrained_state_dict,
    token_logprobs_and_entropy,
    value_model_from_pretrained,
)
from minippo.parallel import (
    apply_activation_checkpointing,
    destroy_distributed,
    full_tensor_buckets,
    gather_full_state_dict,
    init_distributed,
    shard_model,
)
from minippo.rl import (
    explained_variance,
    gae,
    global_counts,
    group_advantages,
    kl_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_whiten,
    place_sequence_rewards,
    policy_loss,
    split_critic_values,
    value_loss,
)
from minippo.rl.correction import build_correction, validate_async_off_policy_correction
from minippo.training.checkpoint import Checkpointer, capture_rng_state, restore_rng_state
from minippo.training.metrics import MetricAverager, NoOpLogger, reduce_over_ranks
from minippo.training.nan_guard import NonFiniteGuard
from minippo.training.optimizers import build_optimizer
from minippo.training.progress import ProgressBar
from minippo.training.rollout_queue import RolloutQueue

log = logging.getLogger("minippo.async_ppo")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def validate_config(cfg: DictConfig, world_size: int, distributed: bool = True) -> None:
    """Every shape and option check that needs no model, with the values and the fix."""
    r, ppo = cfg.rollout, cfg.ppo
    est = cfg.advantage_estimator
    if est not in ("gae", "grpo"):
        raise ValueError(f"advantage_estimator must be 'gae' or 'grpo', got {est!r}")
    if cfg.total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {cfg.total_steps}")
    if r.groups_per_batch % world_size:
        raise ValueError(
            f"rollout.groups_per_batch ({r.groups_per_batch}) must be divisible by the number of "
            f"ranks ({world_size}); set rollout.groups_per_batch="
            f"{max(world_size, r.groups_per_batch // world_size * world_size)}"
        )
    rows = r.groups_per_batch // world_size * r.samples_per_prompt  # rows per rank per step
    if rows % ppo.minibatches:
        raise ValueError(
            f"rows per rank ({rows} = groups_per_batch {r.groups_per_batch} / {world_size} ranks x "
            f"samples_per_prompt {r.samples_per_prompt}) must be divisible by ppo.minibatches "
            f"({ppo.minibatches}); pick ppo.minibatches among "
            f"{[d for d in range(1, rows + 1) if rows % d == 0]}"
        )
    mb_rows = rows // ppo.minibatches
    if mb_rows % ppo.micro_batch_size:
        raise ValueError(
            f"minibatch rows ({mb_rows}) must be divisible by ppo.micro_batch_size "
            f"({ppo.micro_batch_size}); pick one of {[d for d in range(1, mb_rows + 1) if mb_rows % d == 0]}"
        )
    if est == "grpo" and r.samples_per_prompt < 2:
        raise ValueError(
            f"advantage_estimator=grpo compares samples of one prompt: rollout.samples_per_prompt "
            f"({r.samples_per_prompt}) must be >= 2"
        )
    if cfg.kl.coef < 0 or cfg.kl.mode not in ("reward", "loss"):
        raise ValueError(
            f"kl.coef ({cfg.kl.coef}) must be >= 0 and kl.mode ({cfg.kl.mode!r}) 'reward' or 'loss'"
        )
    if cfg.kl.coef > 0 and cfg.kl.mode == "loss" and cfg.kl.estimator == "k1":
        raise ValueError(
            "kl.estimator=k1 with kl.mode=loss has zero expected gradient (E_π[∇log π] = 0); "
            "set kl.estimator=k2 (gradient of KL(π‖π_ref)) or k3 (gradient of KL(π_ref‖π))"
        )
    if est == "gae" and not 0 <= cfg.critic.warmup_steps < cfg.total_steps:
        raise ValueError(
            f"critic.warmup_steps ({cfg.critic.warmup_steps}) must be in [0, total_steps "
            f"({cfg.total_steps}))"
        )
    if ppo.score_micro_batch_size is not None and ppo.score_micro_batch_size < 1:
        raise ValueError(
            f"ppo.score_micro_batch_size must be >= 1 or null, got {ppo.score_micro_batch_size}"
        )
    if cfg.dtype not in DTYPES or cfg.engine_dtype not in DTYPES:
        raise ValueError(
            f"dtype ({cfg.dtype!r}) and engine_dtype ({cfg.engine_dtype!r}) must be in {sorted(DTYPES)}"
        )
    if cfg.dtype != "fp32" and not distributed:
        raise ValueError(
            f"dtype={cfg.dtype} is FSDP2 mixed precision (fp32 master weights), which needs a "
            "process group: run `minippo run --nproc-per-node 1 async_ppo ...`, or set dtype=fp32"
        )


class AsyncPPORecipe:
    """Asynchronous PPO (or critic-free GRPO) with an explicit behaviour-policy correction.

    What one training step does (``train()``; DESIGN.md "One training step"):

    0. take batch ``step`` from the rollout queue. The engine generated it in the background
       (while the previous step trained) with weights at most ``rollout.max_staleness`` versions
       old; every token carries the version that sampled it. ``max_staleness: 0`` is synchronous.
    1. rewards: scored by ``reward`` in the queue's thread as samples arrive; the KL penalty
       (``kl.mode: reward``) is subtracted per token in step 3.
    2. no-grad passes: reference logprobs (when ``kl.coef > 0``), critic values (GAE), and
       ``correction.prepare``: anchor logprobs, per-token IS weights and keep-mask, computed once
       and shared by every epoch and minibatch (docs/corrections.md).
    3. advantages: GAE over per-token rewards (``advantage_estimator: gae``, critic) or
       group-normalised sequence rewards (``grpo``, critic-free).
    4. PPO updates: ``ppo.epochs`` x ``ppo.minibatches`` optimizer steps, each accumulated over
       micro-batches of ``ppo.micro_batch_size`` rows; clipped policy loss x IS weights, clipped
       value loss; the first ``critic.warmup_steps`` steps train only the critic. A non-finite loss
       or gradient norm skips that optimizer step; ``max_consecutive_nonfinite`` in a row stop the
       run. ``correction.after_optimizer_step`` (EWMA) after each actor step.
    5. publish: every rank gathers the full weights bucket by bucket and pushes them into its own
       engine as version ``step + 1``; ``correction.on_weights_published`` (snapshots).
    6. log (jsonl by default, tqdm bar) and, every ``checkpoint.every_n_steps``, an atomic DCP
       checkpoint that a run resumes exactly from (``resume_from: latest``).

    KL to a frozen reference, two ways (``kl.mode``): ``reward`` subtracts β·KL per token from the
    reward (classic RLHF PPO: the penalty flows through GAE and the critic must predict it;
    estimated under the sampling policy μ, no gradient), ``loss`` adds β·KL to the policy loss
    (GRPO-style: no critic involvement, but it fights the clip; its gradient is that of
    KL(π_θ‖π_ref) with ``k2`` and of KL(π_ref‖π_θ) with ``k3``; ``k1`` is refused).

    Parallelism: under torchrun (``minippo run --nproc-per-node N``) actor, critic and reference
    are FSDP2-sharded over all ranks, and each rank drives its own engine with its share
    (``groups_per_batch / N``) of the prompts. A plain single process uses unsharded modules.
    Papers: PPO (Schulman et al. 2017), GAE (Schulman et al. 2016), GRPO (Shao et al. 2024),
    PPO-EWMA (Hilton et al. 2021), decoupled PPO (Fu et al. 2025), TIS (Yao et al. 2025).
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Fail fast: the correction contract and every shape check, before any process group,
        # model, engine or dataset exists.
        validate_async_off_policy_correction(cfg)
        validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")), "RANK" in os.environ)
        self.cfg = cfg
        self.dist = init_distributed()
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.device = self.dist.device
        self.is_main = self.dist.is_main
        if self.device.type == "cpu":
            # the engine process takes the other cores; oversubscribed intra-op threads spin
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(
                cfg.cpu_threads or max(1, (os.cpu_count() or 2) // 2 // ranks_here)
            )
        torch.manual_seed(cfg.seed + self.rank)
        self.total_steps = int(cfg.total_steps)
        self.start_step = 0
        self.temperature = float(cfg.rollout.temperature) or 1.0  # greedy scores at T = 1
        self.use_critic = cfg.advantage_estimator == "gae"
        self.use_ref = cfg.kl.coef > 0
        self.ckpt_path: Path | None = None
        self._batch_ahead = None  # the next step's batch, taken before a checkpoint is saved

    # ------------------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        self.tokenizer = instantiate(cfg.tokenizer)
        self.dataset = instantiate(cfg.dataset, tokenizer=self.tokenizer)
        self.reward_fn = instantiate(cfg.reward)

        # Models: built in full on CPU (random init or an HF folder), the engine copies the
        # actor, then each model moves to the device and is sharded (under torchrun).
        actor = self._build_model(cfg, critic=False)
        if actor.args.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"the model's vocab_size ({actor.args.vocab_size}) is smaller than the tokenizer's "
                f"({self.tokenizer.vocab_size}); set model.vocab_size={self.tokenizer.vocab_size}"
            )
        self.engine = self._build_engine(cfg, actor)
        self.actor = self._place(actor)
        self.critic = self._place(self._build_model(cfg, critic=True)) if self.use_critic else None
        self.ref = None  # frozen: no activation checkpointing, no gradients
        if self.use_ref:
            self.ref = self._place(self._build_model(cfg, critic=False), trainable=False)

        self.optimizer = build_optimizer(cfg.optimizer, self.actor.parameters())
        self.scheduler = instantiate(cfg.lr_scheduler, self.optimizer)
        self.critic_optimizer = self.critic_scheduler = None
        if self.use_critic:
            self.critic_optimizer = build_optimizer(cfg.critic.optimizer, self.critic.parameters())
            self.critic_scheduler = instantiate(cfg.lr_scheduler, self.critic_optimizer)
        self.updates_per_step = cfg.ppo.epochs * cfg.ppo.minibatches
        self.correction = build_correction(  # anchors scored like every no-grad pass
            cfg,
            temperature=self.temperature,
            updates_per_step=self.updates_per_step,
            score_fn=lambda model, b: self._scored(
                partial(response_logprobs, model, temperature=self.temperature), b
            ),
        )
        self.actor_guard = NonFiniteGuard(cfg.max_consecutive_nonfinite)
        self.critic_guard = NonFiniteGuard(cfg.max_consecutive_nonfinite)

        r = cfg.rollout
        self.queue = RolloutQueue(
            self.engine,
            PromptStream(self.dataset, seed=cfg.seed, rank=self.rank, world_size=self.world_size),
            groups_per_batch=r.groups_per_batch // self.world_size,
            samples_per_prompt=r.samples_per_prompt,
            sampling=SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=self.tokenizer.eos_ids if r.stop_at_eos else (),
            ),
            max_staleness=r.max_staleness,
            partial_rollout=r.partial_rollout,
            reward_fn=lambda s: self.reward_fn(s.prompt, s.text),
            decode=self.tokenizer.decode,
            pad_id=self.tokenizer.pad_id,
            seed=cfg.seed * 1000 + self.rank,
        )

        self.checkpointer = Checkpointer(cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last)
        resume = self.checkpointer.resolve(cfg.resume_from)
        if resume is not None:
            self._load_checkpoint(resume)
        # The engine holds exactly the actor's weights, as version `start_step`.
        self._publish(self.start_step)
        self.queue.start()

        self.logger = instantiate(cfg.metric_logger) if self.is_main else NoOpLogger()
        self.logger.log_config(OmegaConf.to_container(cfg, resolve=True))
        self.progress = ProgressBar(
            self.total_steps, self.start_step, enabled=self.is_main and cfg.progress_bar
        )

    def _build_model(self, cfg: DictConfig, *, critic: bool) -> torch.nn.Module:
        path = cfg.critic.checkpoint_path if critic else cfg.checkpoint_path
        if path:
            load = value_model_from_pretrained if critic else from_pretrained
            return load(path, dtype=torch.float32, device="cpu")
        args = instantiate(cfg.model)
        model = ValueModel(args) if critic else Transformer(args)
        return init_weights(model, seed=cfg.seed + (1 if critic else 0))

    def _build_engine(self, cfg: DictConfig, actor: torch.nn.Module):
        # TorchEngine is handed the actor (it copies it into its own process); an engine without
        # a `model` argument (SGLang) loads `model_path` itself. Both receive the actor's weights
        # through publish() before the first request.
        takes_model = "model" in inspect.signature(locate(cfg.engine._component_)).parameters
        return instantiate(cfg.engine, actor) if takes_model else instantiate(cfg.engine)

    def _place(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        model = model.to(self.device).requires_grad_(trainable)
        if trainable and self.cfg.activation_checkpointing:  # recompute each block in backward
            apply_activation_checkpointing(model)
        if self.dist.distributed:  # a plain single process trains unsharded, in fp32
            shard_model(model, param_dtype=DTYPES[self.cfg.dtype])
        return model

    def _publish(self, version: int) -> None:
        """Step 5: full weights bucket by bucket into this rank's engine; snapshot for the
        correction. Collective under FSDP (every rank gathers every tensor)."""
        dtype = DTYPES[self.cfg.engine_dtype]
        buckets = full_tensor_buckets(
            self.actor, bucket_bytes=int(self.cfg.publish_bucket_mb * 2**20), dtype=dtype
        )
        self.queue.publish(buckets, version=version)
        self.correction.on_weights_published(version, self.actor)

    # ------------------------------------------------------------------------------ train
    def train(self) -> None:
        cfg = self.cfg
        for step in range(self.start_step, self.total_steps):
            t_step = time.perf_counter()
            # step 0. the batch of this step (generated in the background)
            rollouts, self._batch_ahead = self._batch_ahead, None  # taken at the last checkpoint
            if rollouts is None:
                rollouts = self.queue.get_batch(step)
            batch = rollouts.batch.to(self.device)
            mask = batch.response_mask
            metrics = dict(rollouts.metrics)

            # step 1. rewards (scored by the queue's thread); debug: inject a NaN
            rewards = batch.rewards
            inject_nan = step in cfg.debug.nan_loss_at_steps
            if inject_nan:
                metrics["debug/nan_injected"] = 1.0

            # step 2. no-grad passes: reference logprobs, critic values, correction anchors
            t_prep = time.perf_counter()
            with torch.no_grad():
                ref_logprobs = values = bootstrap = None
                if self.use_ref:
                    ref_logprobs = self._scored(
                        partial(response_logprobs, self.ref, temperature=self.temperature), batch
                    )
                if self.use_critic:
                    values, bootstrap = split_critic_values(self._scored(self._values, batch), mask)
                corr = self.correction.prepare(batch, self.actor, step=step)

            # step 3. advantages (KL as a reward penalty is estimated under the sampling policy μ)
            kl_tok = None
            if self.use_ref:
                kl_tok = kl_penalty(batch.rollout_logprobs, ref_logprobs, mask, cfg.kl.estimator)
                metrics["train/kl_ref_mean"] = float(masked_mean(kl_tok, mask))
            beta = cfg.kl.coef if (self.use_ref and cfg.kl.mode == "reward") else 0.0
            if self.use_critic:
                token_rewards = place_sequence_rewards(rewards, mask)  # r on the last token
                if beta:
                    token_rewards = token_rewards - beta * kl_tok  # r_t − β·KL_t
                advantages, returns = gae(
                    values,
                    token_rewards,
                    mask,
                    gamma=cfg.gae.gamma,
                    lam=cfg.gae.lam,
                    truncated=batch.truncated,
                    bootstrap_values=bootstrap,
                    bootstrap_truncated=cfg.gae.bootstrap_truncated,
                )
                metrics["train/explained_variance"] = explained_variance(values, returns, mask)
            else:
                seq_rewards = rewards - beta * masked_sum(kl_tok, mask, dim=1) if beta else rewards
                advantages = group_advantages(
                    seq_rewards, batch.group_ids, mask, normalize_std=cfg.grpo.normalize_std
                )
                returns = None
            if cfg.ppo.whiten_advantages:
                advantages = masked_whiten(advantages, mask)  # statistics of all ranks

            # step 4. PPO epochs x minibatches, gradient accumulation over micro-batches
            t_train = time.perf_counter()
            train_actor = not (self.use_critic and step < cfg.critic.warmup_steps)
            stats = self._ppo_updates(
                step,
                batch,
                corr,
                advantages,
                returns,
                values,
                ref_logprobs,
                train_actor,
                inject_nan,
            )
            metrics.update(stats)
            metrics.update(corr.metrics())
            if train_actor:  # the actor's schedule starts with its first update
                self.scheduler.step()
            if self.critic_scheduler is not None:
                self.critic_scheduler.step()

            # step 5. publish version step + 1 into every rank's engine
            t_pub = time.perf_counter()
            self._publish(step + 1)

            # step 6. metrics, progress, checkpoint
            now = time.perf_counter()
            metrics.update(self._perf(rollouts, t_step, t_prep, t_train, t_pub, now))
            metrics["train/lr"] = self.scheduler.get_last_lr()[0]
            metrics["train/actor_updated"] = float(train_actor)
            metrics = self._reduce_over_ranks(metrics)
            if (step + 1) % cfg.log_every_n_steps == 0 or step + 1 == self.total_steps:
                self.logger.log(metrics, step=step)
            self.progress.update(metrics)
            last = step + 1 == self.total_steps
            if (step + 1) % cfg.checkpoint.every_n_steps == 0 or last:
                self.save_checkpoint(step + 1)
        self.progress.close()
        if cfg.checkpoint.export_hf:
            self._export_hf(Path(cfg.output_dir) / "hf_export")
        if self.is_main:
            print(f"metrics: {Path(cfg.metric_logger.get('path', cfg.output_dir)).resolve()}")
            print(f"checkpoint: {self.ckpt_path.resolve() if self.ckpt_path else 'none saved'}")
            if cfg.checkpoint.export_hf:
                print(f"HF export of the actor: {(Path(cfg.output_dir) / 'hf_export').resolve()}")

    def _logprobs_and_entropy(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(
            model,
            batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            temperature=self.temperature,
            start=batch.prompt_len,
        )

    def _scored(self, fn, batch) -> torch.Tensor:
        """fn over row chunks of ``ppo.score_micro_batch_size`` (null: the whole batch at once);
        every rank has the same number of rows, so FSDP's collective forwards line up."""
        n = self.cfg.ppo.score_micro_batch_size or batch.batch_size
        return torch.cat([fn(batch.select(slice(i, i + n))) for i in range(0, batch.batch_size, n)])

    def _values(self, batch) -> torch.Tensor:
        return self.critic(
            batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
        ).float()

    def _ppo_updates(
        self,
        step,
        batch,
        corr,
        advantages,
        returns,
        old_values,
        ref_logprobs,
        train_actor,
        inject_nan,
    ) -> dict[str, float]:
        cfg, ppo = self.cfg, self.cfg.ppo
        W = self.world_size  # FSDP averages gradients over ranks; the losses are sums: × W
        stats = MetricAverager()  # per-token stats weigh by tokens, minibatch values by 1
        add = stats.add

        # A seeded generator per (step, rank): the minibatch order is independent of the global
        # RNG state, so a resumed run shuffles exactly like an uninterrupted one.
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + self.rank)
        for _epoch in range(ppo.epochs):
            perm = torch.randperm(batch.batch_size, generator=gen)
            for rows in perm.chunk(ppo.minibatches):
                # no zero_grad here: every minibatch ends with one (below, also after a skipped
                # step), and nothing between minibatches runs a backward
                n = global_counts(batch.response_mask[rows])
                agg = dict(agg_mode=ppo.loss_agg_mode, global_tokens=n.tokens, global_seqs=n.seqs)
                loss_sum = vloss_sum = 0.0
                # each micro-batch's loss is its share of the minibatch loss (global counts):
                # shares add up, and × W their mean over ranks is the sum over ranks
                shares: dict[str, float] = defaultdict(float)
                for micro in rows.split(ppo.micro_batch_size):
                    mb = batch.select(micro)
                    m = mb.response_mask
                    tokens = float(m.sum())
                    if train_actor:
                        logp, entropy = self._logprobs_and_entropy(self.actor, mb)
                        c = corr.minibatch(micro.to(self.device), logp)
                        loss, st = policy_loss(
                            logp,
                            c.anchor_logprobs,
                            advantages[micro],
                            m,
                            eps_low=ppo.clip_low,
                            eps_high=ppo.clip_high,
                            dual_clip=ppo.dual_clip,
                            weights=c.weights,
                            keep_mask=c.keep_mask,
                            **agg,
                        )
                        if self.use_ref and cfg.kl.mode == "loss":
                            kl, kst = kl_loss(logp, ref_logprobs[micro], m, cfg.kl.estimator, **agg)
                            loss = loss + cfg.kl.coef * kl
                            shares["train/kl_loss"] += kst.pop("train/kl_loss")
                            add(kst, tokens)
                        if inject_nan:
                            loss = loss * float("nan")
                        (loss * W).backward()
                        loss_sum += float(loss.detach())
                        shares["train/policy_loss"] += st.pop("train/policy_loss")
                        st["train/entropy"] = float(masked_mean(entropy.detach(), m))
                        add(st, tokens)
                    if self.use_critic:
                        v, _ = split_critic_values(self._values(mb), m)
                        vloss, vst = value_loss(
                            v,
                            old_values[micro],
                            returns[micro],
                            m,
                            clip_range=ppo.value_clip,
                            **agg,
                        )
                        (vloss * W).backward()
                        vloss_sum += float(vloss.detach())
                        shares["train/value_loss"] += vst.pop("train/value_loss")
                        add(vst, tokens)
                if train_actor:
                    norm = clip_grad_norm_(self.actor.parameters(), ppo.max_grad_norm)
                    if self.actor_guard.check(loss_sum, norm, step=step):
                        self.optimizer.step()
                        self.correction.after_optimizer_step(self.actor)
                    self.optimizer.zero_grad(set_to_none=True)
                    add({"train/grad_norm": float(norm), "train/loss": loss_sum * W})
                if self.use_critic:
                    norm = clip_grad_norm_(self.critic.parameters(), ppo.max_grad_norm)
                    if self.critic_guard.check(vloss_sum, norm, step=step):
                        self.critic_optimizer.step()
                    self.critic_optimizer.zero_grad(set_to_none=True)
                    add({"train/critic_grad_norm": float(norm)})
                add({k: v * W for k, v in shares.items()})
        out = stats.result()
        skipped = self.actor_guard.skipped_total + self.critic_guard.skipped_total
        out["train/nonfinite_skipped_total"] = float(skipped)
        return out

    def _perf(self, rollouts, t_step, t_prep, t_train, t_pub, now) -> dict[str, float]:
        tokens = float(rollouts.batch.response_mask.sum()) * self.world_size
        return {
            "perf/step_s": now - t_step,
            "perf/rewards_and_wait_s": t_prep - t_step,
            "perf/prepare_s": t_train - t_prep,
            "perf/train_s": t_pub - t_train,
            "perf/publish_s": now - t_pub,
            "perf/tokens_per_s": tokens / max(now - t_step, 1e-9),
        }

    def _reduce_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        if not self.dist.distributed:
            return metrics
        gathered: list[dict[str, float]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, metrics)
        return reduce_over_ranks(gathered)

    # ------------------------------------------------------------------------------ checkpoints
    def _models(self) -> dict:
        critic = {"critic": (self.critic, self.critic_optimizer)} if self.use_critic else {}
        return {"actor": (self.actor, self.optimizer), **critic}

    def save_checkpoint(self, step: int) -> None:
        """Atomic DCP checkpoint of everything a resumed run needs to continue exactly.

        The next step's batch is (being) generated with weights older than the saved ones, which
        a resumed run could not rebuild: it is taken from the queue now and stored, so the resumed
        run trains on the very same tokens and its queue continues with the step after it.
        """
        self._batch_ahead = self.queue.get_batch(step)
        extra = {
            "step": step,
            "rng": capture_rng_state(),
            "queue": self.queue.state_dict(),
            "batch_ahead": self._batch_ahead,
            "correction": self.correction.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "critic_scheduler": self.critic_scheduler and self.critic_scheduler.state_dict(),
            "guards": [self.actor_guard.state_dict(), self.critic_guard.state_dict()],
        }
        self.ckpt_path = self.checkpointer.save(step, models=self._models(), extra=extra)

    def _load_checkpoint(self, path: Path) -> None:
        extra, meta = self.checkpointer.load(path, models=self._models())
        self.start_step = int(meta["step"])
        if self.start_step >= self.total_steps:
            raise ValueError(
                f"checkpoint {path} is at step {self.start_step}, but total_steps is "
                f"{self.total_steps}; raise total_steps to continue training"
            )
        restore_rng_state(extra["rng"])
        self.queue.load_state_dict(extra["queue"])
        self._batch_ahead = extra["batch_ahead"]
        self.correction.load_state_dict(extra["correction"])
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.critic_scheduler is not None:
            self.critic_scheduler.load_state_dict(extra["critic_scheduler"])
        self.actor_guard.load_state_dict(extra["guards"][0])
        self.critic_guard.load_state_dict(extra["guards"][1])
        self.ckpt_path = path
        if self.is_main:
            print(f"resumed from {path} at step {self.start_step}")

    def _export_hf(self, path: Path) -> None:
        """The trained actor as an HF folder (config.json + safetensors + tokenizer files)."""
        state = gather_full_state_dict(self.actor, rank0_only=True)  # collective; {} off rank 0
        if self.is_main:
            save_pretrained_state_dict(state, self.actor.args, path)
            src = self.cfg.checkpoint_path
            for name in TOKENIZER_FILES:
                if src and (Path(src) / name).is_file():
                    shutil.copy(Path(src) / name, path / name)

    def cleanup(self) -> None:
        for close in ("progress", "queue", "engine", "logger"):
            obj = getattr(self, close, None)
            if obj is not None:
                (obj.shutdown if close == "engine" else obj.close)()
        if self.dist.distributed:
            destroy_distributed()


def recipe_main(cfg: DictConfig) -> None:
    recipe = AsyncPPORecipe(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    from minippo.config import parse_recipe_args

    logging.basicConfig(level=os.environ.get("MINIPPO_LOG_LEVEL", "WARNING"))
    recipe_main(parse_recipe_args())
