"""Asynchronous PPO for LLMs on one node (manual: the AsyncPPORecipe docstring, docs/recipe.md).

    minippo run async_ppo --config tiny_cpu                         # CPU, under a minute
    minippo run --nproc-per-node 8 async_ppo --config qwen3_4b_dapo_math_8gpu
    python recipes/async_ppo.py --config configs/tiny_cpu.yaml total_steps=20

Copy it with ``minippo cp async_ppo my_ppo.py`` and edit; nothing imports this file."""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_

from minippo import models, parallel, rl
from minippo.config import instantiate, torch_dtype
from minippo.data import PromptStream
from minippo.engine import SamplingParams
from minippo.engine.torch_engine import TorchEngine
from minippo.plan import rollout_mode, sglang_on_gpu
from minippo.rl.correction import build_correction
from minippo.training import preflight
from minippo.training.alternating_queue import AlternatingQueue
from minippo.training.checkpoint import Checkpointer, RNGState
from minippo.training.evaluation import evaluate
from minippo.training.interrupt import StopOnSignal
from minippo.training.metrics import MetricAverager, NoOpLogger, gather_and_reduce
from minippo.training.micro_batches import split_rows
from minippo.training.nan_guard import NonFiniteGuard
from minippo.training.optimizers import build_optimizer
from minippo.training.output_dir import OutputDir
from minippo.training.progress import ProgressBar
from minippo.training.rollout_queue import RolloutQueue

log = logging.getLogger("minippo.async_ppo")
# each rank logs its share of these losses; the logged value is their sum over ranks
LOSS_SHARES = ("train/loss", "train/policy_loss", "train/kl_loss", "train/value_loss")


def validate_config(cfg: DictConfig, world_size: int, distributed: bool = True) -> None:
    """Every check that needs no model, all problems at once, each with its values and fix
    (``minippo validate`` and the torchrun launcher run it too): keys, types and ranges
    (``preflight.ASYNC_PPO_SCHEMA``), components, the correction contract, then the shapes
    (``preflight.async_ppo_shape_problems``)."""
    preflight.check_async_ppo_config(cfg, world_size, distributed)


class AsyncPPORecipe:
    """Asynchronous PPO (or critic-free GRPO) with an explicit behaviour-policy correction.

    What one training step does (``train()``; DESIGN.md "One training step"):

    0. take batch ``step`` from the rollout queue; every token carries the version that sampled
       it, at most ``rollout.max_staleness`` versions old. ``rollout.mode: overlap``: the engine
       generated it in the background while the previous step trained. ``alternate`` (a GPU
       shared with the engine): it is generated now, carried-over groups continuing under the
       new weights, then the engine sleeps (``rollout.offload_trainer``: the trainer's state
       waits on the host meanwhile).
    1. rewards: scored by ``reward`` as samples arrive (overlap: in the queue's thread); the KL penalty
       (``kl.mode: reward``) is subtracted per token in step 3.
    2. no-grad passes: reference logprobs (when ``kl.coef > 0``), critic values (GAE), and
       ``correction.prepare``: anchor logprobs, per-token IS weights and keep-mask, computed once
       and shared by every epoch and minibatch (docs/corrections.md).
    3. advantages: GAE over per-token rewards (``advantage_estimator: gae``, critic) or
       group-normalised sequence rewards (``grpo``, critic-free).
    4. PPO updates: ``ppo.epochs`` x ``ppo.minibatches`` optimizer steps, each accumulated over
       micro-batches of ``ppo.max_tokens_per_micro_batch`` tokens or ``ppo.micro_batch_size``
       rows (both null: one forward per minibatch); clipped policy loss x IS weights, clipped
       value loss; the first ``critic.warmup_steps`` steps train only the critic. A non-finite loss
       or gradient norm skips that optimizer step; ``max_consecutive_nonfinite`` in a row stop the
       run. ``correction.after_optimizer_step`` (EWMA) after each actor step.
    5. publish (every ``rollout.sync_every`` steps): every rank gathers the full weights bucket by
       bucket and pushes them into its own engine as version ``(step + 1) // sync_every``;
       ``correction.on_weights_published`` (snapshots).
    6. log (jsonl by default, tqdm bar) and, every ``checkpoint.every_n_steps``, an atomic DCP
       checkpoint that a run resumes exactly from (``resume_from: latest``).

    KL to a frozen reference (``kl.mode``): ``reward`` subtracts β·KL per token from the reward
    (classic RLHF PPO, estimated under μ), ``loss`` adds β·KL to the policy loss (GRPO-style;
    ``k2``/``k3`` only, docs/recipe.md).
    Packed passes (``ppo.pack``, the default): every training and scoring forward computes on the
    real tokens of its sequences only, packed into one stream (``minippo.models.packing``); the
    per-token tensors stay ``[B, R]``. ``pack: false`` computes on the padded batch (the
    reference the tests compare packing with).
    Parallelism: under torchrun (``minippo run --nproc-per-node N``) the models are built on the
    meta device, FSDP2-sharded over all ranks (``parallel.sharding: hsdp``: over a node's ranks,
    replicated across nodes; docs/multinode.md) and filled shard by shard; each rank drives its own
    engine with ``groups_per_batch / N`` prompts. A single process trains unsharded. Losses are
    each rank's share of the global loss (global token counts); FSDP sums the gradients.
    Papers: PPO (Schulman et al. 2017), GAE (Schulman et al. 2016), GRPO (Shao et al. 2024),
    PPO-EWMA (Hilton et al. 2021), decoupled PPO (Fu et al. 2025), TIS (Yao et al. 2025).
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Fail fast: every config and input check, all problems at once, before any process
        # group, model, engine or dataset exists and before anything is written.
        validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")), "RANK" in os.environ)
        preflight.check_inputs(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg = cfg
        self.dist = parallel.init_distributed()
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.device, self.is_main = self.dist.device, self.dist.is_main
        # parallel.sharding: FSDP over every rank, or HSDP (shards in a node, replicas across nodes)
        self.mesh = (
            parallel.build_mesh(parallel.sharding_of(cfg)) if self.dist.distributed else None
        )
        if self.device.type == "cpu":
            # the engine process takes the other cores; oversubscribed intra-op threads spin
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(
                cfg.cpu_threads or max(1, (os.cpu_count() or 2) // 2 // ranks_here)
            )
        if self.device.type == "cuda" and sglang_on_gpu(cfg) and rollout_mode(cfg) == "overlap":
            # the engine generates on this GPU while training (rollout.share_gpu_with_engine,
            # refused unless the plan fits): the trainer's allocator gets what its plan says
            from minippo.plan import trainer_memory_fraction

            fraction = trainer_memory_fraction(cfg, world_size=self.world_size)
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        torch.manual_seed(cfg.seed + self.rank)
        self.total_steps = int(cfg.total_steps)
        self.start_step = 0
        self.temperature = float(cfg.rollout.temperature) or 1.0  # greedy scores at T = 1
        self.use_critic = rl.needs_critic(cfg.advantage_estimator)
        self.use_ref = cfg.kl.coef > 0
        # weights reach the engines every `sync_every` steps; versions count publishes, so step
        # s trains on data of version s // sync_every or older (docs/recipe.md, "Sync cycles")
        self.sync_every = int(cfg.rollout.get("sync_every", 1))
        # ppo and kl as plain attributes: the micro-batch loop reads them a few hundred times a
        # step, and a DictConfig lookup costs 10-30 µs
        self.ppo = SimpleNamespace(**OmegaConf.to_container(cfg.ppo, resolve=True))
        self.kl = SimpleNamespace(**OmegaConf.to_container(cfg.kl, resolve=True))
        self.pack = bool(cfg.ppo.get("pack", True))  # packed passes: real tokens only
        self.ckpt_path: Path | None = None  # the last checkpoint saved or loaded
        self.progress = self.queue = self.engine = self.logger = None  # built by setup
        self.output_dir = OutputDir.of_run(cfg)  # one run per output_dir, locked until cleanup
        if self.is_main:
            self.output_dir.claim()
        self.interrupt = StopOnSignal().install()  # SIGTERM/SIGINT: checkpoint at step end, stop

    # ------------------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        self.tokenizer = instantiate(cfg.tokenizer)
        r = cfg.rollout  # the ids that end a response (EOS, rollout.stop_tokens), checked at start
        self.stop_ids = preflight.stop_ids(
            self.tokenizer, r.get("stop_tokens"), stop_at_eos=r.stop_at_eos
        )
        self.dataset = instantiate(cfg.dataset, tokenizer=self.tokenizer)
        preflight.warn_if_prompts_cycle(len(self.dataset), cfg.rollout.groups_per_batch)
        self.reward_fn = instantiate(cfg.reward)
        self.eval_set = None  # validation prompts (`eval`), scored by the same reward
        if cfg.get("eval") is not None:
            self.eval_set = instantiate(cfg.eval.dataset, tokenizer=self.tokenizer)

        # Models: built on the meta device, sharded (under torchrun), then filled with the
        # checkpoint's or a seeded random init's weights. The engine is built from the model
        # config and receives its weights through the first publish.
        args = self._model_args(cfg.checkpoint_path)  # its vocabulary fits the tokenizer: preflight
        longest = {"dataset": preflight.longest_prompt(self.dataset)}  # prompt + budget fit
        if self.eval_set is not None:
            longest["eval.dataset"] = preflight.longest_prompt(self.eval_set)
        preflight.raise_problems(preflight.context_problems(cfg, args, prompt_tokens=longest))
        self.engine = instantiate(cfg.engine, model_args=args)
        self.actor = self._build_model(args, cfg.checkpoint_path, seed=cfg.seed)
        self.critic = None
        if self.use_critic:
            path = cfg.critic.checkpoint_path
            self.critic = self._build_model(
                self._model_args(path), path, seed=cfg.seed + 1, critic=True
            )
        self.ref = None  # frozen: no activation checkpointing, no gradients
        if self.use_ref:
            self.ref = self._build_model(args, cfg.checkpoint_path, seed=cfg.seed, trainable=False)

        self.optimizer = build_optimizer(cfg.optimizer, self.actor.parameters())
        self.scheduler = instantiate(cfg.lr_scheduler, self.optimizer)
        self.critic_optimizer = self.critic_scheduler = None
        if self.use_critic:
            self.critic_optimizer = build_optimizer(cfg.critic.optimizer, self.critic.parameters())
            self.critic_scheduler = instantiate(cfg.lr_scheduler, self.critic_optimizer)
        # the weights the engines hold inside a sync cycle, for the anchors of its later steps
        self.published = parallel.PublishedWeights() if self.sync_every > 1 else None
        self.correction = build_correction(  # instantiate(cfg.correction, temperature=..., ...)
            cfg,
            temperature=self.temperature,
            updates_per_step=cfg.ppo.epochs * cfg.ppo.minibatches * self.sync_every,
            score_fn=lambda model, b: self._scored(partial(self._logprobs, model), b),
        )
        self.actor_guard = NonFiniteGuard(cfg.max_consecutive_nonfinite)
        self.critic_guard = NonFiniteGuard(cfg.max_consecutive_nonfinite)

        r = cfg.rollout
        alternate = rollout_mode(cfg) == "alternate"
        queue_kw = dict(oversample=float(r.get("oversample", 1.0)), sleep=True) if alternate else {}
        self.queue = (AlternatingQueue if alternate else RolloutQueue)(
            self.engine,
            PromptStream(self.dataset, seed=cfg.seed, rank=self.rank, world_size=self.world_size),
            groups_per_batch=r.groups_per_batch // self.world_size,
            samples_per_prompt=r.samples_per_prompt,
            sampling=SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=self.stop_ids,
            ),
            max_staleness=r.max_staleness,
            partial_rollout=r.partial_rollout,
            reward_fn=lambda s: self.reward_fn(s.prompt, s.text),
            reward_name=cfg.reward._component_,  # named in the error for a NaN or a non-number
            decode=self.tokenizer.decode,
            pad_id=self.tokenizer.pad_id,
            seed=cfg.seed * 1000 + self.rank,
            sync_every=self.sync_every,
            **queue_kw,
        )
        if alternate and isinstance(self.engine, TorchEngine) and self.is_main:
            groups = self.queue.in_flight  # over-provisioned groups per rank
            rows = groups * r.samples_per_prompt
            preflight.warn_if_oversample_waits(rows, groups, self.engine.max_batch_size)
        self.offload = None  # the trainer's state moves to the host while the engine generates
        if r.get("offload_trainer", False):
            pairs = [(m, o) for m, o in self._models().values()]
            self.offload = parallel.TrainerOffload(pairs)

        # Everything a resumed run needs besides the models: Stateful objects, saved by name.
        self.states = {
            "rng": RNGState(),
            "queue": self.queue,  # with the batch it generated ahead for the next step
            "correction": self.correction,
            "published": self.published,  # None unless sync_every > 1: not saved
            "scheduler": self.scheduler,
            "critic_scheduler": self.critic_scheduler,  # None without a critic: not saved
            "actor_guard": self.actor_guard,
            "critic_guard": self.critic_guard,
        }
        self.states = {name: obj for name, obj in self.states.items() if obj is not None}
        self.checkpointer = Checkpointer(
            cfg.checkpoint.dir,
            keep_last=cfg.checkpoint.keep_last,
            shared=OmegaConf.select(cfg, "parallel.shared_output_dir", default=True),
        )
        resume = self.checkpointer.resolve(cfg.resume_from)
        if resume is not None:
            self._load_checkpoint(resume)
        # resumed at total_steps (preflight allows it only when the run was killed during its
        # HF export): nothing to generate or train, the export is all that is left
        training = self.start_step < self.total_steps
        # The engine holds the weights of the version `start_step` trains from: the actor's, or
        # inside a sync cycle (a resume) the cycle's published ones.
        if training:
            with self._cycle_weights(self.start_step):
                self._publish(self.start_step // self.sync_every)
            self.queue.start()

        self.logger = instantiate(cfg.metric_logger) if self.is_main else NoOpLogger()
        self.logger.log_config(OmegaConf.to_container(cfg, resolve=True))
        if training and self.eval_set is not None and cfg.eval.before_train:
            self._validate(self.start_step)
        self.progress = ProgressBar(
            self.total_steps, self.start_step, enabled=self.is_main and cfg.progress_bar
        )

    def _build_model(self, args, path, *, seed: int, critic: bool = False, trainable: bool = True):
        """Meta-device build → activation checkpointing → compiled blocks → FSDP2 shards →
        weights (an HF folder, read one tensor at a time, or a seeded init that equals an
        unsharded one)."""
        with torch.device("meta"):
            model = models.ValueModel(args) if critic else models.Transformer(args)
        model.requires_grad_(trainable)
        if trainable and self.cfg.activation_checkpointing:  # recompute each block in backward
            parallel.apply_activation_checkpointing(model)
        if self.cfg.get("compile", False):  # fuse each block's small ops, forward and backward
            parallel.compile_blocks(model)
        if self.dist.distributed:  # a plain single process trains unsharded, in fp32
            dtype = torch_dtype(self.cfg.dtype)
            parallel.shard_model(model, mesh=self.mesh, param_dtype=dtype, sum_gradients=True)
        model.to_empty(device=self.device)
        if path:
            return models.load_pretrained_weights(model, path)
        return models.init_weights(model, seed=seed)

    def _model_args(self, path):
        """The architecture: an HF folder's config.json, or the ``model`` size builder."""
        return models.model_args_from_pretrained(path) if path else instantiate(self.cfg.model)

    def _cycle_weights(self, step: int):
        """Inside a sync cycle (``step % sync_every != 0``) the actor holds the weights published
        at the cycle's start in this block, its own ones afterwards; otherwise nothing changes
        (the actor holds them already)."""
        if self.published is None or step % self.sync_every == 0:
            return nullcontext()
        return self.published.holding(self.actor)

    def _publish(self, version: int) -> None:
        """Step 5: full weights bucket by bucket into this rank's engine, in the engine's dtype;
        snapshot for the correction. Collective under FSDP (every rank gathers every tensor)."""
        if self.published is not None:
            self.published.take(self.actor, version)
        buckets = parallel.full_tensor_buckets(
            self.actor,
            bucket_bytes=int(self.cfg.publish_bucket_mb * 2**20),
            dtype=self.engine.dtype,
        )
        if self.device.type == "cuda" and rollout_mode(self.cfg) == "alternate":
            torch.cuda.empty_cache()  # the engine wakes into what the trainer leaves cached
        self.queue.publish(buckets, version=version)
        self.correction.on_weights_published(version, self.actor)
        self._retain_referenced()

    def _retain_referenced(self) -> None:
        """keep_old_actor: keep a snapshot only of the versions that queued or carried tokens
        still reference (the union over ranks: every rank scores the same versions)."""
        versions = parallel.union_over_ranks(self.queue.referenced_versions(), self.device)
        self.correction.retain(versions)

    # ------------------------------------------------------------------------------ train
    def train(self) -> None:
        cfg = self.cfg
        for step in range(self.start_step, self.total_steps):
            t_step = time.perf_counter()
            # steps 0-1. the batch of this step, generated and scored (rewards)
            offload_s = self.offload.offload() if self.offload is not None else 0.0
            rollouts = self.queue.get_batch(step)
            if self.offload is not None:
                offload_s += self.offload.reload()
            batch = rollouts.batch.to(self.device)
            mask, rewards, metrics = batch.response_mask, batch.rewards, dict(rollouts.metrics)

            # step 2. no-grad passes: reference logprobs, critic values, correction anchors
            t_prep = time.perf_counter()
            with torch.no_grad():
                ref_logprobs = values = bootstrap = None
                if self.use_ref:
                    ref_logprobs = self._scored(partial(self._logprobs, self.ref), batch)
                if self.use_critic:
                    values, bootstrap = rl.split_critic_values(
                        self._scored(self._values, batch), mask
                    )
                version = step // self.sync_every  # the engines' weights, anchoring this step
                with self._cycle_weights(step):
                    corr = self.correction.prepare(batch, self.actor, step=version)
            self._retain_referenced()

            # step 3. advantages (KL as a reward penalty is estimated under the sampling policy μ)
            kl_tok = None
            if self.use_ref:
                kl_tok = rl.kl_penalty(batch.rollout_logprobs, ref_logprobs, mask, cfg.kl.estimator)
                metrics["train/kl_ref_mean"] = float(rl.masked_mean(kl_tok, mask))
            beta = cfg.kl.coef if (self.use_ref and cfg.kl.mode == "reward") else 0.0
            if self.use_critic:
                token_rewards = rl.place_sequence_rewards(rewards, mask)  # r on the last token
                if beta:
                    token_rewards = token_rewards - beta * kl_tok  # r_t − β·KL_t
                advantages, returns = rl.gae(
                    values,
                    token_rewards,
                    mask,
                    gamma=cfg.gae.gamma,
                    lam=cfg.gae.lam,
                    truncated=batch.truncated,
                    bootstrap_values=bootstrap,
                    bootstrap_truncated=cfg.gae.bootstrap_truncated,
                )
                metrics["train/explained_variance"] = rl.explained_variance(values, returns, mask)
            else:
                seq_rewards = (
                    rewards - beta * rl.masked_sum(kl_tok, mask, dim=1) if beta else rewards
                )
                advantages = rl.group_advantages(
                    seq_rewards, batch.group_ids, mask, normalize_std=cfg.grpo.normalize_std
                )
                returns = None
            if cfg.ppo.whiten_advantages:
                advantages = rl.masked_whiten(advantages, mask)  # statistics of all ranks

            # step 4. PPO epochs x minibatches, gradient accumulation over micro-batches
            t_train = time.perf_counter()
            train_actor = not (self.use_critic and step < cfg.critic.warmup_steps)
            plan = self._update_plan(step, rollouts.batch.attention_mask, batch.prompt_len)
            inputs = (batch, corr, advantages, returns, values, ref_logprobs, train_actor)
            metrics |= self._ppo_updates(step, plan, *inputs) | corr.metrics()
            if train_actor:  # the actor's schedule starts with its first update
                self.scheduler.step()
            if self.critic_scheduler is not None:
                self.critic_scheduler.step()

            # step 5. publish version (step + 1) / sync_every into every rank's engine
            t_pub = time.perf_counter()
            if (step + 1) % self.sync_every == 0:
                self._publish((step + 1) // self.sync_every)

            # step 6. metrics, progress, checkpoint
            now = time.perf_counter()
            metrics |= {
                "perf/step_s": now - t_step,
                "perf/rewards_and_wait_s": t_prep - t_step,
                "perf/prepare_s": t_train - t_prep,
                "perf/train_s": t_pub - t_train,
                "perf/publish_s": now - t_pub,
                "perf/offload_s": offload_s,
                "perf/tokens_per_s": float(mask.sum()) * self.world_size / max(now - t_step, 1e-9),
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/actor_updated": float(train_actor),
                "correction/anchor_version": float(version),
            }
            metrics = gather_and_reduce(metrics, summed=LOSS_SHARES)  # rank 0 logs
            if (step + 1) % cfg.log_every_n_steps == 0 or step + 1 == self.total_steps:
                self.logger.log(metrics, step=step)
            self.progress.update(metrics)
            every = cfg.eval.every_n_steps if self.eval_set is not None else None
            published = (step + 1) % self.sync_every == 0  # the engines hold the actor
            if every and published and ((step + 1) % every == 0 or step + 1 == self.total_steps):
                self._validate(step + 1)
            self.interrupt.at_step_end(step + 1, save=self.save_checkpoint)  # after a signal
            if (step + 1) % cfg.checkpoint.every_n_steps == 0 or step + 1 == self.total_steps:
                self.save_checkpoint(step + 1)
        self.progress.close()
        export = self.output_dir.export_dir
        if cfg.checkpoint.export_hf:
            parallel.export_hf(
                self.actor, export, tokenizer_dir=cfg.checkpoint_path, step=self.total_steps
            )
        if self.is_main:
            print(f"metrics: {Path(cfg.metric_logger.get('path', cfg.output_dir)).resolve()}")
            print(f"checkpoint: {self.ckpt_path.resolve() if self.ckpt_path else 'none saved'}")
            print(f"HF export of the actor: {export if cfg.checkpoint.export_hf else 'none'}")

    def _validate(self, steps_done: int) -> None:
        """Validation: sample ``eval.samples_per_prompt`` responses per ``eval.dataset`` prompt from
        the engines (they hold the actor's weights: right after a publish), score them with the
        run's reward, log ``eval/*`` at step ``steps_done``. Seeded requests, no global RNG, and
        the queue generates nothing meanwhile: with TorchEngine (or a deterministic SGLang engine,
        whose sampler honours per-request seeds) the run trains exactly as without it."""
        cfg, r = self.cfg.eval, self.cfg.rollout
        sampling = SamplingParams(
            temperature=r.temperature if cfg.temperature is None else cfg.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=cfg.max_new_tokens or r.max_new_tokens,
            stop_token_ids=self.stop_ids,
        )
        with self.queue.engine_idle():
            result = evaluate(
                self.engine,
                self.eval_set,
                reward_fn=self.reward_fn,
                decode=self.tokenizer.decode,
                sampling=sampling,
                samples_per_prompt=cfg.samples_per_prompt,
                seed=self.cfg.seed,
            )
        self.logger.log({**result.metrics, "perf/eval_s": result.seconds}, step=steps_done)

    def _pack(self, host_mask, rows, prompt_len):
        """The packed layout of ``rows`` (on the host; None with ``ppo.pack: false``)."""
        return models.pack(host_mask[rows], start=prompt_len) if self.pack else None

    def _scored(self, fn, batch) -> torch.Tensor:
        """``fn(chunk, layout)`` over the forwards of ``ppo.score_max_tokens_per_micro_batch``
        tokens or ``ppo.score_micro_batch_size`` rows (both null: the whole batch at once), back
        in row order; every rank runs as many forwards, so FSDP's collectives line up. Packing
        reads the attention mask on the host (one copy from the device per pass)."""
        host_mask = batch.attention_mask.cpu()
        (chunks,) = split_rows(
            [torch.arange(batch.batch_size)],
            host_mask.sum(1),
            max_tokens=getattr(self.ppo, "score_max_tokens_per_micro_batch", None),
            max_rows=self.ppo.score_micro_batch_size,
            device=self.device,
        )
        outs = []
        for rows in chunks:
            layout = self._pack(host_mask, rows, batch.prompt_len)
            outs.append(fn(batch.select(rows), None if layout is None else layout.to(self.device)))
        order = torch.cat(chunks)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return torch.cat(outs)[inverse.to(self.device)]

    def _logprobs(self, model, batch, layout) -> torch.Tensor:  # at the sampling temperature
        return models.response_logprobs(model, batch, temperature=self.temperature, packed=layout)

    def _values(self, batch, layout) -> torch.Tensor:
        return self.critic(
            batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            packed=layout,
        ).float()

    def _update_plan(self, step, host_mask, prompt_len) -> list[list[tuple[torch.Tensor, object]]]:
        """Step 4's forwards, planned on the host before it starts: per optimizer step (epochs x
        minibatches) its micro-batches as (rows, packed layout), the layouts on the host (moved
        to the device one micro-batch at a time). A seeded generator per (step, rank): the
        minibatch order is independent of the global RNG state, so a resumed run shuffles
        exactly like an uninterrupted one."""
        ppo, B = self.ppo, host_mask.shape[0]
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + self.rank)
        minibatches = [
            rows
            for _epoch in range(ppo.epochs)
            for rows in torch.randperm(B, generator=gen).chunk(ppo.minibatches)
        ]
        micros = split_rows(
            minibatches,
            host_mask.sum(1),
            max_tokens=getattr(ppo, "max_tokens_per_micro_batch", None),
            max_rows=ppo.micro_batch_size,
            device=self.device,
        )
        return [[(m, self._pack(host_mask, m, prompt_len)) for m in mbs] for mbs in micros]

    def _ppo_updates(
        self, step, plan, batch, corr, advantages, returns, old_values, ref_logprobs, train_actor
    ) -> dict[str, float]:
        """Step 4 along ``plan`` (:meth:`_update_plan`). A micro-batch's loss is its share of the
        minibatch loss over all ranks (global token/sequence counts): shares add up over
        micro-batches by gradient accumulation and over ranks by FSDP's gradient sum, whatever
        rows each micro-batch holds. Statistics stay on the device until ``result()``; the only
        other host syncs are the finite checks, one per optimizer step."""
        stats = MetricAverager()  # per-token stats weigh by tokens, minibatch values by 1
        for micros in plan:
            rows = torch.cat([m for m, _ in micros])
            counts = rl.global_counts(batch.response_mask[rows])
            shares: dict[str, torch.Tensor] = {}  # this rank's loss shares of the minibatch
            for i, (micro, layout) in enumerate(micros):
                last = i == len(micros) - 1  # HSDP: gradients cross nodes once per minibatch
                parallel.set_replica_sync(self.actor, last)
                parallel.set_replica_sync(self.critic, last)
                mb = batch.select(micro)
                layout = None if layout is None else layout.to(self.device)
                if train_actor:
                    ref = None if ref_logprobs is None else ref_logprobs[micro]
                    out = self._actor_backward(
                        mb, micro, corr, advantages[micro], ref, counts, layout
                    )
                    self._add_shares(shares, out, stats, mb)
                if self.use_critic:
                    out = self._critic_backward(
                        mb, old_values[micro], returns[micro], counts, layout
                    )
                    self._add_shares(shares, out, stats, mb)
            if train_actor:
                loss = shares["train/loss"]
                norm, stepped = self._clip_and_step(
                    self.actor, self.optimizer, self.actor_guard, loss, step
                )
                if stepped:
                    self.correction.after_optimizer_step(self.actor)  # EWMA's θ̄ update
                stats.add({"train/grad_norm": norm})
            if self.use_critic:
                loss = shares["train/value_loss"]
                norm, _ = self._clip_and_step(
                    self.critic, self.critic_optimizer, self.critic_guard, loss, step
                )
                stats.add({"train/critic_grad_norm": norm})
            stats.add(shares)
        out = stats.result()
        skipped = self.actor_guard.skipped_total + self.critic_guard.skipped_total
        out["train/nonfinite_skipped_total"] = float(skipped)
        return out

    def _actor_backward(self, mb, rows, corr, advantages, ref_logprobs, counts, layout):
        """Backward of one micro-batch's policy loss (+ β·KL with ``kl.mode: loss``); returns
        (its loss shares, its per-token statistics). ``layout``: packed (or None: padded)."""
        ppo, kl_cfg, m = self.ppo, self.kl, mb.response_mask
        agg = dict(agg_mode=ppo.loss_agg_mode, global_tokens=counts.tokens, global_seqs=counts.seqs)
        score = dict(
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            temperature=self.temperature,
            start=mb.prompt_len,
            packed=layout,
        )
        if getattr(ppo, "fused_loss", False):
            return self._actor_backward_fused(mb, rows, corr, advantages, ref_logprobs, agg, score)
        logp, entropy = models.token_logprobs_and_entropy(self.actor, mb.input_ids, **score)
        c = corr.minibatch(rows.to(self.device), logp)  # anchors, IS weights, keep-mask
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
        if self.use_ref and kl_cfg.mode == "loss":
            kl, kst = rl.kl_loss(logp, ref_logprobs, m, kl_cfg.estimator, **agg)
            loss = loss + kl_cfg.coef * kl
            shares["train/kl_loss"] = kst.kl_loss
            per_token["train/kl_mean"] = kst.kl_mean
        loss.backward()
        shares["train/loss"] = loss.detach()
        return shares, per_token

    def _actor_backward_fused(self, mb, rows, corr, advantages, ref_logprobs, agg, score):
        """``_actor_backward`` with ``ppo.fused_loss``: the same loss, gradients and statistics
        from ``models.fused_policy_loss`` (the lm_head and the loss in one chunked pass, nothing
        recomputed in backward). Anchors that follow the current policy are formed token by token
        inside that pass; only a correction whose weights need whole rows of them (``tis`` at
        sequence level with one update per step) gets the micro-batch's logprobs from one extra
        no-grad forward first."""
        ppo, kl_cfg, m = self.ppo, self.kl, mb.response_mask
        rows = rows.to(self.device)
        token_anchors = corr.token_anchors(rows)
        if token_anchors is not None:
            anchors = dict(anchor_logprobs=None, token_anchors=token_anchors)
        else:
            lp = None
            if corr.follows_policy:
                with torch.no_grad():
                    lp = models.token_logprobs(self.actor, mb.input_ids, **score)
            c = corr.minibatch(rows, lp)
            anchors = dict(
                anchor_logprobs=c.anchor_logprobs, weights=c.weights, keep_mask=c.keep_mask
            )
        with_kl = self.use_ref and kl_cfg.mode == "loss"
        spec = models.FusedLossSpec(
            **anchors,
            advantages=advantages,
            response_mask=m,
            eps_low=ppo.clip_low,
            eps_high=ppo.clip_high,
            dual_clip=ppo.dual_clip,
            ref_logprobs=ref_logprobs if with_kl else None,
            kl_estimator=kl_cfg.estimator,
            kl_coef=kl_cfg.coef,
            **agg,
        )
        out = models.fused_policy_loss(self.actor, mb.input_ids, spec, **score)
        if token_anchors is not None:
            corr.minibatch(rows, out.logprobs)  # the weight statistics of these tokens
        per_token = rl.as_metrics(out.stats)
        shares = {"train/policy_loss": per_token.pop("train/policy_loss")}
        per_token["train/entropy"] = rl.masked_mean(out.entropy, m)
        if with_kl:
            shares["train/kl_loss"] = out.kl_stats.kl_loss
            per_token["train/kl_mean"] = out.kl_stats.kl_mean
        out.loss.backward()
        shares["train/loss"] = out.loss.detach()
        return shares, per_token

    def _critic_backward(self, mb, old_values, returns, counts, layout):
        """Backward of one micro-batch's clipped value loss; returns (shares, statistics)."""
        ppo = self.ppo
        v, _ = rl.split_critic_values(self._values(mb, layout), mb.response_mask)
        vloss, st = rl.value_loss(
            v,
            old_values,
            returns,
            mb.response_mask,
            clip_range=ppo.value_clip,
            agg_mode=ppo.loss_agg_mode,
            global_tokens=counts.tokens,
            global_seqs=counts.seqs,
        )
        vloss.backward()
        per_token = rl.as_metrics(st)
        return {"train/value_loss": per_token.pop("train/value_loss")}, per_token

    @staticmethod
    def _add_shares(shares, out, stats, mb) -> None:
        """Sum a micro-batch's loss shares; token-weight its per-token statistics."""
        mb_shares, per_token = out
        for k, v in mb_shares.items():
            shares[k] = shares.get(k, 0.0) + v
        stats.add(per_token, mb.response_mask.sum())

    def _clip_and_step(self, model, optimizer, guard, loss, step: int) -> tuple[torch.Tensor, bool]:
        """Clip the gradient norm; step unless the loss or the norm is not finite (the guard
        skips it, and stops the run after too many in a row). Returns (norm, stepped)."""
        norm = clip_grad_norm_(model.parameters(), self.ppo.max_grad_norm)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: replicated
        stepped = guard.check(loss, norm, step=step)
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    # ------------------------------------------------------------------------------ checkpoints
    def _models(self) -> dict:
        critic = {"critic": (self.critic, self.critic_optimizer)} if self.use_critic else {}
        return {"actor": (self.actor, self.optimizer), **critic}

    def save_checkpoint(self, step: int) -> None:
        """Atomic DCP checkpoint of the models and every Stateful in ``self.states``, from which
        a run resumes exactly (the queue saves the batch it generated ahead itself)."""
        self.ckpt_path = self.checkpointer.save(step, models=self._models(), states=self.states)

    def _load_checkpoint(self, path: Path) -> None:
        meta = self.checkpointer.load(path, models=self._models(), states=self.states)
        self.start_step = int(meta["step"])  # < total_steps, world size as saved: preflight
        self.ckpt_path = path
        if self.is_main:
            print(f"resumed from {path} at step {self.start_step}")

    def cleanup(self) -> None:
        for part in (self.progress, self.queue, self.logger):
            if part is not None:
                part.close()
        if self.engine is not None:  # after the queue, which may still be generating
            self.engine.shutdown()
        self.output_dir.release()
        self.interrupt.uninstall()
        if self.dist.distributed:
            parallel.destroy_distributed()


def recipe_main(cfg: DictConfig) -> None:
    recipe = AsyncPPORecipe(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":  # errors end in one line (MINIPPO_LOG_LEVEL=DEBUG: the traceback)
    from minippo.config import run_recipe

    run_recipe(recipe_main)
