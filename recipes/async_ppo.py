"""Asynchronous PPO for LLMs on one node (manual: the AsyncPPORecipe docstring, docs/recipe.md).

    minippo run async_ppo --config tiny_cpu                         # CPU, under a minute
    minippo run --nproc-per-node 8 async_ppo --config qwen3_4b_dapo_math_8gpu
    python recipes/async_ppo.py --config configs/tiny_cpu.yaml total_steps=20

Copy it with ``minippo cp async_ppo my_ppo.py`` and edit; nothing imports this file."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import DictConfig, OmegaConf

from minippo import models, parallel, rl
from minippo.config import instantiate, torch_dtype
from minippo.data import PromptStream
from minippo.engine import SamplingParams
from minippo.engine.torch_engine import default_num_threads
from minippo.env import build_multi_turn
from minippo.rl.correction import build_correction
from minippo.training import preflight
from minippo.training.checkpoint import Checkpointer, RNGState
from minippo.training.evaluation import evaluate
from minippo.training.interrupt import StopOnSignal
from minippo.training.metrics import MetricAverager, NoOpLogger, gather_and_reduce
from minippo.training.micro_batches import scored_in_forwards, update_plan
from minippo.training.nan_guard import NonFiniteGuard, clip_and_step
from minippo.training.optimizers import build_optimizer
from minippo.training.output_dir import OutputDir
from minippo.training.placement import cap_trainer_memory, rollout_mode
from minippo.training.progress import ProgressBar
from minippo.training.rank_balance import balance_over_ranks
from minippo.training.rollout_queue import RolloutQueue
from minippo.training.update_bound import UpdateBound

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

    One training step (``train()``; docs/recipe.md "One training step" says why each is so):

    0. batch ``step`` from the rollout queue, every token at most ``rollout.max_staleness``
       versions old: generated in the background while the previous step trained
       (``rollout.mode: overlap``), or now, then the engine sleeps (``alternate``). With
       ``env`` every sample is a multi-turn episode: an environment answers each model turn with
       observation tokens (response_mask 0, version -1) until it ends it (docs/multi_turn.md).
    1. rewards: scored by ``reward`` as the samples arrive (an episode: by its environment).
    2. no-grad passes: reference logprobs (``kl.coef > 0``), critic values (GAE) and
       ``correction.prepare``: the step's anchors, IS weights and keep-mask (docs/corrections.md).
    3. advantages: GAE over per-token rewards (``advantage_estimator: gae``, with a critic) or
       group-normalised sequence rewards (``grpo``); ``kl.mode: reward`` subtracts β·KL per token.
    4. PPO updates: ``ppo.epochs`` x ``ppo.minibatches`` optimizer steps, each accumulated over
       micro-batches (``ppo.max_tokens_per_micro_batch`` tokens or ``ppo.micro_batch_size``
       rows): the clipped policy loss x IS weights, fused with the lm_head (+ β·KL with
       ``kl.mode: loss``, − η·entropy), and the clipped value loss (the first
       ``critic.warmup_steps`` steps: the critic only). A non-finite loss or gradient norm skips
       that optimizer step. Each LR schedule advances once per step in which its optimizer stepped.
    5. publish, every ``rollout.sync_every`` steps: every rank gathers the full weights bucket by
       bucket into its own engine as version ``(step + 1) // sync_every``.
    6. log; every ``checkpoint.every_n_steps`` an atomic checkpoint to resume exactly from.

    Every forward computes on the real tokens only (``ppo.pack``). Under torchrun the models are
    built on the meta device and FSDP2-sharded (``parallel.sharding``), each rank drives its own
    engine with ``groups_per_batch / N`` prompts, whole groups then move between ranks to even
    their tokens (``ppo.balance_ranks``), and each loss is the rank's share of the global loss; a
    single process trains unsharded. Papers: PPO (Schulman et al. 2017), GAE (Schulman
    et al. 2016), GRPO (Shao et al. 2024), PPO-EWMA (Hilton et al. 2021), decoupled PPO (Fu et
    al. 2025), TIS (Yao et al. 2025).
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Fail fast: every config and input check, all problems at once, before any process
        # group, model, engine or dataset exists and before anything is written.
        validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")), "RANK" in os.environ)
        preflight.check_inputs(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg = cfg
        self.dist = parallel.init_distributed(cfg=cfg)  # parallel.timeout_s, deterministic
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.device, self.is_main = self.dist.device, self.dist.is_main
        # parallel.sharding: FSDP over every rank, or HSDP (shards in a node, replicas across nodes)
        sharding = parallel.sharding_of(cfg)
        self.mesh = parallel.build_mesh(sharding) if self.dist.distributed else None
        if self.device.type == "cpu":  # half the cores: the engines take the other half
            torch.set_num_threads(cfg.cpu_threads or default_num_threads())
        # an SGLang engine generating on this GPU while the trainer trains (overlap, refused
        # unless the plan fits): the trainer's allocator gets what its plan says
        cap_trainer_memory(cfg, self.device, world_size=self.world_size)
        torch.manual_seed(cfg.seed + self.rank)
        self.total_steps = int(cfg.total_steps)
        self.start_step = 0
        self.temperature = float(cfg.rollout.temperature) or 1.0  # greedy scores at T = 1
        self.use_critic = rl.needs_critic(cfg.advantage_estimator)
        self.use_ref = cfg.kl.coef > 0
        # weights reach the engines every `sync_every` steps; versions count publishes, so step
        # s trains on data of version s // sync_every or older (docs/recipe.md, "Sync cycles")
        self.sync_every = int(preflight.setting(cfg, "rollout.sync_every"))
        # ppo and kl as plain attributes: the loop reads them often (a DictConfig lookup: 10-30 µs)
        self.ppo = SimpleNamespace(**preflight.section(cfg, "ppo"))  # omitted keys: defaults
        self.kl = SimpleNamespace(**OmegaConf.to_container(cfg.kl, resolve=True))
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
        # env: multi-turn episodes (an environment answers each turn; docs/multi_turn.md)
        budget = cfg.rollout.max_new_tokens  # the whole response, model and observation tokens
        self.multi_turn = build_multi_turn(cfg, self.tokenizer, args.vocab_size, budget)
        self.actor = self._build_model(args, cfg.checkpoint_path, seed=cfg.seed)
        self.critic = self.ref = None  # the reference: frozen, no activation checkpointing
        if self.use_critic:
            path = cfg.critic.checkpoint_path
            critic_args = self._model_args(path)
            self.critic = self._build_model(critic_args, path, seed=cfg.seed + 1, critic=True)
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
        max_kl = (
            self.ppo.max_update_kl
        )  # shorten or undo an actor step that moved its tokens further
        self.update_bound = UpdateBound(max_kl) if max_kl is not None else None

        r = cfg.rollout
        self.sampling = SamplingParams(
            r.temperature, r.top_p, r.top_k, r.max_new_tokens, stop_token_ids=self.stop_ids
        )
        self.queue = RolloutQueue(  # rollout.mode: overlap (a producer thread) or alternate
            self.engine,
            PromptStream(self.dataset, seed=cfg.seed, rank=self.rank, world_size=self.world_size),
            groups_per_batch=r.groups_per_batch // self.world_size,
            samples_per_prompt=r.samples_per_prompt,
            sampling=self.sampling,
            max_staleness=r.max_staleness,
            partial_rollout=r.partial_rollout,
            reward_fn=lambda s: self.reward_fn(s.prompt, s.text),
            reward_name=cfg.reward._component_,  # named in the error for a NaN or a non-number
            decode=self.tokenizer.decode,
            pad_id=self.tokenizer.pad_id,
            seed=cfg.seed * 1000 + self.rank,
            sync_every=self.sync_every,
            mode=rollout_mode(cfg),
            oversample=float(preflight.setting(cfg, "rollout.oversample")),
            multi_turn=self.multi_turn,  # None: single-turn samples
        )
        if self.is_main and self.queue.mode == "alternate" and self.engine.max_batch_size:
            groups = self.queue.in_flight  # over-provisioned groups per rank
            rows = groups * r.samples_per_prompt
            preflight.warn_if_oversample_waits(rows, groups, self.engine.max_batch_size)
        self.offload = None  # the trainer's state moves to the host while the engine generates
        if preflight.setting(cfg, "rollout.offload_trainer"):
            self.offload = parallel.TrainerOffload(list(self._models().values()))

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
            shared=preflight.setting(cfg, "parallel.shared_output_dir"),
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
        enabled = self.is_main and cfg.progress_bar
        self.progress = ProgressBar(self.total_steps, self.start_step, enabled=enabled)

    def _build_model(self, args, path, *, seed: int, critic: bool = False, trainable: bool = True):
        """Meta-device build → activation checkpointing → compiled blocks → FSDP2 shards →
        weights (an HF folder, read one tensor at a time, or a seeded init that equals an
        unsharded one)."""
        with torch.device("meta"):
            model = models.ValueModel(args) if critic else models.Transformer(args)
        model.requires_grad_(trainable)
        if trainable and self.cfg.activation_checkpointing:  # recompute each block in backward
            parallel.apply_activation_checkpointing(model)
        if preflight.setting(
            self.cfg, "compile"
        ):  # fuse each block's small ops, forward and backward
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
        size, dtype = int(self.cfg.publish_bucket_mb * 2**20), self.engine.dtype
        buckets = parallel.full_tensor_buckets(self.actor, bucket_bytes=size, dtype=dtype)
        if self.device.type == "cuda" and self.queue.mode == "alternate":
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
            batch, balance = rollouts.batch.to(self.device), {}
            if self.ppo.balance_ranks:  # whole groups move so that every rank has as many tokens
                batch, balance = balance_over_ranks(batch, self.device)
            mask, rewards, metrics = batch.response_mask, batch.rewards, rollouts.metrics | balance

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
                advantages, returns = rl.gae(  # gae: gamma, lam, bootstrap_truncated
                    values, token_rewards, mask, truncated=batch.truncated,
                    bootstrap_values=bootstrap, **cfg.gae,
                )  # fmt: skip
                metrics["train/explained_variance"] = rl.explained_variance(values, returns, mask)
            else:
                if beta:  # the penalty summed over each response
                    rewards = rewards - beta * rl.masked_sum(kl_tok, mask, dim=1)
                advantages = rl.group_advantages(rewards, batch.group_ids, mask, **cfg.grpo)
                returns = None
            metrics["train/advantage_zero_frac"] = rl.near_zero_fraction(advantages, mask, rewards)
            if cfg.ppo.whiten_advantages:
                advantages = rl.masked_whiten(advantages, mask)  # statistics of all ranks

            # step 4. PPO epochs x minibatches, gradient accumulation over micro-batches
            t_train = time.perf_counter()
            train_actor = not (self.use_critic and step < cfg.critic.warmup_steps)
            host = (batch if balance else rollouts.batch).attention_mask.cpu()  # moved rows: a copy
            plan = self._update_plan(step, host, batch.prompt_len)
            inputs = (batch, corr, advantages, returns, values, ref_logprobs, train_actor)
            updates, stepped = self._ppo_updates(step, plan, *inputs)
            metrics |= updates | corr.metrics()
            # a schedule advances after a step in which its optimizer stepped: the actor's starts
            # with its first update, a step whose updates were all skipped (non-finite) is not one
            if stepped["actor"]:
                self.scheduler.step()
            if stepped["critic"]:
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
        the engines (right after a publish: they hold the actor's weights), score them with the
        run's reward, log ``eval/*`` at step ``steps_done``. Seeded requests, no global RNG, the
        queue idle meanwhile: with TorchEngine (or a deterministic SGLang engine) the run trains
        exactly as without it."""
        cfg, r = self.cfg.eval, self.sampling  # the rollouts' sampling with eval's T and budget
        t = r.temperature if cfg.temperature is None else cfg.temperature
        sampling = replace(r, temperature=t, max_new_tokens=cfg.max_new_tokens or r.max_new_tokens)
        with self.queue.engine_idle():
            result = evaluate(
                self.engine, self.eval_set, reward_fn=self.reward_fn, decode=self.tokenizer.decode,
                sampling=sampling, samples_per_prompt=cfg.samples_per_prompt, seed=self.cfg.seed,
                multi_turn=self.multi_turn,
            )  # fmt: skip
        self.logger.log({**result.metrics, "perf/eval_s": result.seconds}, step=steps_done)

    def _scored(self, fn, batch) -> torch.Tensor:
        """A no-grad pass ``fn(chunk, layout)`` in forwards of
        ``ppo.score_max_tokens_per_micro_batch`` tokens or ``ppo.score_micro_batch_size`` rows."""
        max_tokens = self.ppo.score_max_tokens_per_micro_batch
        return scored_in_forwards(
            fn, batch, max_tokens=max_tokens, max_rows=self.ppo.score_micro_batch_size,
            pack=self.ppo.pack, device=self.device,
        )  # fmt: skip

    def _logprobs(self, model, batch, layout) -> torch.Tensor:  # at the sampling temperature
        return models.response_logprobs(model, batch, temperature=self.temperature, packed=layout)

    def _values(self, batch, layout) -> torch.Tensor:
        kw = dict(position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        return self.critic(batch.input_ids, packed=layout, **kw).float()

    def _update_plan(self, step, host_mask, prompt_len) -> list[list[tuple[torch.Tensor, object]]]:
        """Step 4's forwards, planned on the host before it starts: per optimizer step its
        micro-batches as (rows, packed layout on the host). A seeded generator per (step, rank):
        a resumed run shuffles exactly like an uninterrupted one, whatever the global RNG."""
        ppo = self.ppo
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + self.rank)
        return update_plan(
            host_mask, gen, epochs=ppo.epochs, minibatches=ppo.minibatches,
            max_tokens=ppo.max_tokens_per_micro_batch,
            max_rows=ppo.micro_batch_size, pack_start=prompt_len if ppo.pack else None,
            device=self.device,
        )  # fmt: skip

    def _ppo_updates(
        self, step, plan, batch, corr, advantages, returns, old_values, ref_logprobs, train_actor
    ) -> tuple[dict[str, float], dict[str, bool]]:
        """Step 4 along ``plan`` (:meth:`_update_plan`). A micro-batch's loss is its share of the
        minibatch loss over all ranks (global token/sequence counts): shares add up over
        micro-batches by gradient accumulation and over ranks by FSDP's gradient sum, whatever
        rows each micro-batch holds. Statistics stay on the device until ``result()``; the only
        other host syncs are the finite checks, one per optimizer step, and with
        ``ppo.max_update_kl`` the KL of each actor step (:meth:`_bound_update`). Returns (the
        statistics, whether the actor's and the critic's optimizer stepped at least once)."""
        stats = MetricAverager()  # per-token stats weigh by tokens, minibatch values by 1
        stepped = {"actor": False, "critic": False}
        clip = dict(max_norm=self.ppo.max_grad_norm, step=step)  # non-finite: the step is skipped
        for micros in plan:
            counts = rl.global_counts(batch.response_mask[torch.cat([m for m, _ in micros])])
            shares: dict[str, torch.Tensor] = {}  # this rank's loss shares of the minibatch
            scored = []  # (micro-batch, layout, its logprobs before the step): ppo.max_update_kl
            for i, (micro, layout) in enumerate(micros):
                last = i == len(micros) - 1  # HSDP: gradients cross nodes once per minibatch
                parallel.set_replica_sync(self.actor, last)
                parallel.set_replica_sync(self.critic, last)
                mb = batch.select(micro)
                layout = None if layout is None else layout.to(self.device)
                if train_actor:
                    ref = None if ref_logprobs is None else ref_logprobs[micro]
                    *out, logprobs = self._actor_backward(
                        mb, micro, corr, advantages[micro], ref, counts, layout
                    )
                    self._add_shares(shares, out, stats, mb)
                    scored.append((mb, layout, logprobs))
                if self.use_critic:
                    v_old, ret = old_values[micro], returns[micro]
                    out = self._critic_backward(mb, v_old, ret, counts, layout)
                    self._add_shares(shares, out, stats, mb)
            if train_actor:
                loss, guard = shares["train/loss"], self.actor_guard
                if self.update_bound is not None:
                    self.update_bound.snapshot(self.actor, self.optimizer)
                norm, ok = clip_and_step(self.actor, self.optimizer, guard, loss, **clip)
                stepped["actor"] |= ok
                if ok and self.update_bound is not None:
                    ok = self._bound_update(scored, counts, stats, step)
                if ok:
                    self.correction.after_optimizer_step(self.actor)  # EWMA's θ̄ update
                stats.add({"train/grad_norm": norm})
            if self.use_critic:
                loss, guard = shares["train/value_loss"], self.critic_guard
                norm, ok = clip_and_step(self.critic, self.critic_optimizer, guard, loss, **clip)
                stepped["critic"] |= ok
                stats.add({"train/critic_grad_norm": norm})
            stats.add(shares)
        out = stats.result()
        if self.update_bound is not None and train_actor:
            shortened, undone = self.update_bound.take_counts()
            out |= {
                "train/updates_shortened": float(shortened),
                "train/updates_undone": float(undone),
            }
        skipped = self.actor_guard.skipped_total + self.critic_guard.skipped_total
        out["train/nonfinite_skipped_total"] = float(skipped)
        return out, stepped

    def _bound_update(self, scored, counts, stats, step) -> bool:
        """``ppo.max_update_kl``: the KL of the actor step just taken on its own rows, one no-grad
        forward of them with the stepped weights; a step over the bound is shortened or undone
        (:class:`~minippo.training.update_bound.UpdateBound`). False: undone. Logs
        ``train/update_kl`` (before any shortening)."""
        bound = self.update_bound

        @torch.no_grad()
        def measure() -> torch.Tensor:
            kl = torch.zeros((), device=self.device)
            for mb, layout, before in scored:
                after = models.token_logprobs(self.actor, mb.input_ids, **self._scoring(mb, layout))
                kl = kl + bound.kl(before, after, mb.response_mask, counts.tokens)
            return kl

        kept, kl = bound.settle(measure, self.actor, self.optimizer, step)
        stats.add({"train/update_kl": torch.tensor(kl)})
        return kept

    def _scoring(self, mb, layout) -> dict:
        """The keywords that score a micro-batch's response tokens with the actor (the fused loss
        and the update bound's re-score): its masks, the sampling temperature, packed or not."""
        return dict(
            attention_mask=mb.attention_mask, position_ids=mb.position_ids,
            temperature=self.temperature, start=mb.prompt_len, packed=layout,
        )  # fmt: skip

    def _actor_backward(self, mb, rows, corr, advantages, ref_logprobs, counts, layout):
        """Backward of one micro-batch's policy loss (+ β·KL with ``kl.mode: loss``); returns (its
        loss shares, its per-token statistics, its logprobs). The lm_head and the loss run as one
        chunked pass that forms their gradients in the forward, so backward recomputes no logits
        (``models.fused_policy_loss``: ``rl.policy_loss``'s loss, statistics and gradients, which
        the tests compare it with). Anchors that follow the current policy are formed token by
        token inside the pass; only weights that need whole rows of them (``tis`` at sequence
        level, one update per step) take one no-grad forward first. ``layout``: packed or None."""
        ppo, kl, m = self.ppo, self.kl, mb.response_mask
        agg = dict(agg_mode=ppo.loss_agg_mode, global_tokens=counts.tokens, global_seqs=counts.seqs)
        score = self._scoring(mb, layout)
        rows = rows.to(self.device)
        token_anchors = corr.token_anchors(rows)
        if token_anchors is not None:
            anchors = dict(anchor_logprobs=None, token_anchors=token_anchors)
        else:
            lp = None
            if corr.follows_policy:
                with torch.no_grad():
                    lp = models.token_logprobs(self.actor, mb.input_ids, **score)
            c = corr.minibatch(rows, lp)  # anchors, IS weights, keep-mask
            anchors = dict(
                anchor_logprobs=c.anchor_logprobs, weights=c.weights, keep_mask=c.keep_mask
            )
        with_kl = self.use_ref and kl.mode == "loss"
        spec = models.FusedLossSpec(
            **anchors, **agg, advantages=advantages, response_mask=m, eps_low=ppo.clip_low,
            eps_high=ppo.clip_high, dual_clip=ppo.dual_clip, kl_estimator=kl.estimator,
            ref_logprobs=ref_logprobs if with_kl else None, kl_coef=kl.coef,
            entropy_coef=ppo.entropy_coef,
        )  # fmt: skip
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
        return shares, per_token, out.logprobs

    def _critic_backward(self, mb, old_values, returns, counts, layout):
        """Backward of one micro-batch's clipped value loss; returns (shares, statistics)."""
        ppo, m = self.ppo, mb.response_mask
        agg = dict(agg_mode=ppo.loss_agg_mode, global_tokens=counts.tokens, global_seqs=counts.seqs)
        v, _ = rl.split_critic_values(self._values(mb, layout), m)
        vloss, st = rl.value_loss(v, old_values, returns, m, clip_range=ppo.value_clip, **agg)
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

    # ------------------------------------------------------------------------------ checkpoints
    def _models(self) -> dict:
        critic = {"critic": (self.critic, self.critic_optimizer)} if self.use_critic else {}
        return {"actor": (self.actor, self.optimizer), **critic}

    def save_checkpoint(self, step: int) -> None:
        """Atomic DCP checkpoint of the models and every Stateful in ``self.states``, from which
        a run resumes exactly (the queue saves the batch it generated ahead itself)."""
        config = OmegaConf.to_container(self.cfg, resolve=True)  # what a resume must not change
        self.ckpt_path = self.checkpointer.save(
            step, models=self._models(), states=self.states, meta={"config": config}
        )

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
