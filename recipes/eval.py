"""Evaluate a policy: mean reward, pass@k, response lengths, truncation (manual: the EvalRecipe
docstring, docs/eval.md).

    minippo run eval --config tiny_eval_cpu                          # CPU, seconds
    minippo run eval --config tiny_eval_cpu training_checkpoint=/tmp/minippo/tiny_cpu/checkpoints
    minippo run --nproc-per-node 8 eval --config my_eval.yaml        # each rank a share
    python recipes/eval.py --config configs/tiny_eval_cpu.yaml samples_per_prompt=8

Copy it with ``minippo cp eval my_eval.py`` and edit; nothing imports this file."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from minippo import models, parallel
from minippo.config import instantiate
from minippo.config.schema import Anything, Bool, Component, Dtype, Float, Int, Section, Spec, Str
from minippo.engine import SamplingParams
from minippo.env import build_multi_turn
from minippo.training import evaluation, preflight
from minippo.training.checkpoint import Checkpointer, verify_checkpoint
from minippo.training.metrics import NoOpLogger
from minippo.training.output_dir import OutputDir

log = logging.getLogger("minippo.eval")

# What this recipe reads (docs/configs.md, "eval"). Component nodes list only the arguments
# checked for a range; the others are bound to the callable's signature.
EVAL_SCHEMA: dict[str, Spec] = {
    "output_dir": Str(),
    "overwrite_output_dir": Bool(optional=True),
    "seed": Int(min=0),
    "cpu_threads": Int(min=1, null=True),
    "publish_bucket_mb": Float(gt=0),
    "checkpoint_path": Str(null=True),
    "model": Component(null=True),
    "training_checkpoint": Str(null=True),
    "tokenizer": Component(),
    "dataset": Component({"num_examples": Int(min=1, null=True)}),
    "reward": Component(),
    "engine": Component({"dtype": Dtype(), "max_batch_size": Int(min=1)}),
    "samples_per_prompt": Int(min=1),
    "pass_k": Anything(),  # null or a list of ints in [1, samples_per_prompt]: validate_config
    "correct_threshold": Float(null=True),
    "sampling": Section(
        {
            "temperature": Float(min=0),
            "top_p": Float(gt=0, max=1),
            "top_k": Int(min=0),
            "max_new_tokens": Int(min=1),
            "stop_at_eos": Bool(),
            "stop_tokens": Anything(optional=True),  # checked against the tokenizer at start
        }
    ),
    "samples_path": Str(),
    "metric_logger": Component(),
    "progress_bar": Bool(),
    # multi-turn episodes, as in training (docs/multi_turn.md); null: single-turn samples
    "env": preflight.ASYNC_PPO_SCHEMA["env"],
    "multi_turn": preflight.ASYNC_PPO_SCHEMA["multi_turn"],
}


def validate_config(cfg: DictConfig, world_size: int, distributed: bool = True) -> None:
    """Every check that needs no model, all problems at once (``minippo validate`` and the torchrun
    launcher run it too): keys, types and ranges (EVAL_SCHEMA), components, ``pass_k``, and the
    files of ``training_checkpoint`` (complete, holding an actor of the configured shape)."""
    problems = preflight.config_problems(cfg, EVAL_SCHEMA, world_size=world_size)
    if problems:  # the checks below need well-typed values
        preflight.raise_problems(problems)
    n = cfg.samples_per_prompt
    if cfg.pass_k is not None:
        ks = list(cfg.pass_k) if isinstance(cfg.pass_k, ListConfig) else None
        if not ks or any(
            not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n for k in ks
        ):
            problems.append(
                f"pass_k must be null or a list of integers in [1, samples_per_prompt ({n})], got "
                f"{OmegaConf.to_container(cfg.pass_k) if ks is not None else cfg.pass_k!r}; e.g. "
                f"pass_k=[1,{n}]"
            )
    problems += preflight.multi_turn_problems(cfg, "sampling.max_new_tokens")
    if cfg.training_checkpoint is not None:
        problems += training_checkpoint_problems(cfg)
    elif cfg.checkpoint_path is None:
        problems.append(
            "checkpoint_path and training_checkpoint are both null: nothing to evaluate; set "
            "checkpoint_path to an HF folder or training_checkpoint to an async_ppo checkpoint"
        )
    preflight.raise_problems(problems)


def training_checkpoint_problems(cfg: DictConfig) -> list[str]:
    """``training_checkpoint`` resolves to a complete checkpoint whose actor has the shapes of
    the model the config builds (``checkpoint_path``'s config.json, else ``model``)."""
    key = f"training_checkpoint={cfg.training_checkpoint}"
    try:
        path = resolve_training_checkpoint(cfg.training_checkpoint)
        verify_checkpoint(path)
    except (OSError, ValueError) as e:
        return [f"{key}: {e}"]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    actor = {k[len("actor.") :]: v.size for k, v in saved.items() if k.startswith("actor.")}
    if not actor:
        return [f"{key}: {path} holds no actor weights (not a checkpoint of the async_ppo recipe)"]
    try:
        args = model_args(cfg)
    except (OSError, ValueError, TypeError):
        return []  # the files' check (preflight.input_problems) names the model's problem
    with torch.device("meta"):
        expected = {n: p.shape for n, p in models.Transformer(args).state_dict().items()}
    wrong = [n for n in expected if n not in actor or tuple(actor[n]) != tuple(expected[n])]
    wrong += sorted(set(actor) - set(expected))
    if wrong:
        name = wrong[0]  # the first in the model's order
        return [
            f"{key}: the actor's {name!r} is {tuple(actor[name]) if name in actor else 'missing'}, "
            f"the configured model has {tuple(expected[name]) if name in expected else 'none'}: "
            "set checkpoint_path (or model) to the architecture the run trained"
        ]
    return []


def resolve_training_checkpoint(value: str) -> Path:
    """A ``step_*`` folder, or a checkpoint folder whose ``latest`` names one."""
    path = Path(value).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; give the checkpoint folder of an async_ppo run (its "
            "checkpoint.dir, e.g. /tmp/minippo/tiny_cpu/checkpoints) or one of its step_* folders"
        )
    resolved = Checkpointer(path).resolve(str(path), key="training_checkpoint")
    assert resolved is not None
    return resolved


def model_args(cfg: DictConfig) -> models.ModelArgs:
    """The architecture: ``checkpoint_path``'s config.json, or the ``model`` size builder."""
    if cfg.checkpoint_path:
        return models.model_args_from_pretrained(cfg.checkpoint_path)
    return instantiate(cfg.model)


class EvalRecipe:
    """Evaluate a policy on a prompt set with a rollout engine.

    What it does (``evaluate()``; the numbers are ``minippo.training.evaluation.evaluate``'s, the
    same code the training recipe can validate with):

    1. weights: an HF folder (``checkpoint_path``) or the actor of an async_ppo training
       checkpoint (``training_checkpoint``: a ``step_*`` folder or the checkpoint folder, whose
       ``latest`` is taken; architecture from ``checkpoint_path`` or ``model``) are read into a
       model in the engine's dtype, published into the engine bucket by bucket, and freed.
    2. sampling: ``samples_per_prompt`` responses per prompt of ``dataset`` (its split and
       ``num_examples`` are dataset arguments), each request with its own seed derived from
       ``seed`` and its position (the same samples on any number of ranks).
    3. scoring: ``reward(example, response)``; a sample is correct when its reward reaches
       ``correct_threshold`` (null: the reward's maximum, 1.0 for the built-in rewards).
    4. report: ``eval/reward_mean``, ``eval/pass@k`` for each k of ``pass_k`` (unbiased
       estimator of Chen et al. 2021, averaged over prompts), ``eval/response_len_mean``,
       ``eval/truncated_frac``, ``eval/prompts``, ``eval/samples``: printed, and logged by
       ``metric_logger`` at the checkpoint's step (0 for an HF folder); one JSON line per sample
       (prompt, answer, response, reward, correct, length, finish reason) in ``samples_path``.
       With ``env`` set every sample is an episode of that environment, run as in training
       (docs/multi_turn.md): its reward is the environment's, and ``eval/turns_mean`` is added.

    Engines: TorchEngine on CPU (``in_process: true``: generation in a thread of this process,
    with ``cpu_threads`` torch threads), SGLangEngine on a GPU (its ``model_path`` an HF folder
    with the model's config.json; docs/eval.md).
    Parallelism: under torchrun (``minippo run --nproc-per-node N eval ...``) every rank builds
    its own engine and evaluates the prompts at positions ``rank, rank + N, ...``; the metrics
    are reduced over all prompts (the same numbers as one rank) and rank 0 writes every rank's
    samples to ``samples_path``.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Fail fast: every config and input check, all problems at once, before anything exists.
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate_config(cfg, world, "RANK" in os.environ)
        preflight.check_inputs(cfg, world)
        self.cfg = cfg
        self.dist = parallel.init_distributed(cfg=cfg)  # parallel.timeout_s, deterministic
        self.rank, self.device, self.is_main = self.dist.rank, self.dist.device, self.dist.is_main
        if self.device.type == "cpu":  # an in-process TorchEngine generates with these threads
            ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // ranks_here))
        self.engine = self.logger = None  # built by setup
        self.source, self.step = "", 0  # what setup loads: the weights' origin, its step
        # samples_path and the metrics file: one run per folder (preflight checked it)
        self.output_dir = OutputDir.of_run(cfg)
        if self.is_main:
            self.output_dir.claim()

    def setup(self, cfg: DictConfig) -> None:
        self.tokenizer = instantiate(cfg.tokenizer)
        self.dataset = instantiate(cfg.dataset, tokenizer=self.tokenizer)
        self.reward_fn = instantiate(cfg.reward)
        self.stop_ids = preflight.stop_ids(  # EOS and sampling.stop_tokens, checked at start
            self.tokenizer,
            cfg.sampling.get("stop_tokens"),
            stop_at_eos=cfg.sampling.stop_at_eos,
            key="sampling.stop_tokens",
        )
        args = model_args(cfg)  # its vocabulary fits the tokenizer: preflight
        self.engine = instantiate(cfg.engine, model_args=args)
        # env: every sample an episode of the environment (reward, pass@k, turns)
        budget = cfg.sampling.max_new_tokens  # the whole response, observation tokens included
        self.multi_turn = build_multi_turn(cfg, self.tokenizer, args.vocab_size, budget)
        self.step = self._publish_weights(args)
        self.logger = instantiate(cfg.metric_logger) if self.is_main else NoOpLogger()
        self.logger.log_config(OmegaConf.to_container(cfg, resolve=True))

    def _publish_weights(self, args: models.ModelArgs) -> int:
        """Step 1: a model in the engine's dtype on this rank's device, filled from the training
        checkpoint's actor or the HF folder, published as version 0, then freed. Returns the
        training checkpoint's step (0 for an HF folder)."""
        cfg = self.cfg
        with torch.device("meta"):
            model = models.Transformer(args)
        model = model.to(self.engine.dtype).to_empty(device=self.device).eval()
        step = 0
        if cfg.training_checkpoint is not None:
            path = resolve_training_checkpoint(cfg.training_checkpoint)
            step = load_actor(model, path)
            self.source = f"{path} (actor, step {step})"
        else:
            models.load_pretrained_weights(model, cfg.checkpoint_path)
            self.source = str(Path(cfg.checkpoint_path).expanduser().resolve())
        buckets = parallel.full_tensor_buckets(
            model, bucket_bytes=int(cfg.publish_bucket_mb * 2**20), dtype=self.engine.dtype
        )
        self.engine.publish_weights(buckets, version=0)
        del model, buckets
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return step

    def evaluate(self) -> dict[str, float]:
        cfg, s = self.cfg, self.cfg.sampling
        # steps 2-3. sample this rank's share, score, reduce the metrics over every rank
        result = evaluation.evaluate(
            self.engine,
            self.dataset,
            reward_fn=self.reward_fn,
            decode=self.tokenizer.decode,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_new_tokens=s.max_new_tokens,
                stop_token_ids=self.stop_ids,
            ),
            samples_per_prompt=cfg.samples_per_prompt,
            seed=cfg.seed,
            pass_k=None if cfg.pass_k is None else list(cfg.pass_k),
            correct_threshold=cfg.correct_threshold,
            progress=self.is_main and cfg.progress_bar,
            multi_turn=self.multi_turn,
        )
        # step 4. every rank's samples to rank 0's jsonl; metrics logged and printed
        rows = evaluation.gather_samples(result.samples)
        self.logger.log(result.metrics, step=self.step)
        if self.is_main:
            path = evaluation.write_samples(rows, cfg.samples_path)
            n = cfg.samples_per_prompt
            print(f"eval of {self.source}: {len(self.dataset)} prompts x {n} samples")
            print(evaluation.format_metrics(result.metrics))
            print(f"samples: {path.resolve()}")
            if cfg.metric_logger.get("path"):
                print(f"metrics: {Path(cfg.metric_logger.path).resolve()}")
        return result.metrics

    def cleanup(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.engine is not None:
            self.engine.shutdown()
        self.output_dir.release()
        if self.dist.distributed:
            parallel.destroy_distributed()


def load_actor(model: torch.nn.Module, path: Path) -> int:
    """Read the actor's weights of training checkpoint ``path`` into ``model`` (a plain module,
    any dtype: DCP casts and gathers the saved shards of any number of ranks into full tensors);
    the optimizer, critic and other states are not read. Returns the checkpoint's step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = verify_checkpoint(path)
    state = get_state_dict(model, [])[0]
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"actor": state}, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, [], model_state_dict=state, optim_state_dict={})
    return int(meta["step"])


def recipe_main(cfg: DictConfig) -> None:
    recipe = EvalRecipe(cfg)
    try:
        recipe.setup(cfg)
        recipe.evaluate()
    finally:
        recipe.cleanup()


if __name__ == "__main__":  # errors end in one line (MINIPPO_LOG_LEVEL=DEBUG: the traceback)
    from minippo.config import run_recipe

    run_recipe(recipe_main)
