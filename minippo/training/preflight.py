"""Checks of a run's config and inputs before anything is built or written.

``minippo run`` (in the launcher, before torchrun starts a rank, and again in each recipe's
``__init__``) and ``minippo validate`` run the same checks, so they agree, and each reports every
problem it finds at once, one line each, naming the key or the file and the fix:

* :func:`config_problems`: the keys, types and ranges the recipe declares
  (:data:`ASYNC_PPO_SCHEMA`; unknown keys, from a YAML file as from the command line, get the
  closest declared keys), every ``_component_`` imported and bound to its signature, the
  behaviour-policy correction contract, and the rollout.mode of an SGLang engine on the
  trainer's GPU (``minippo.plan.shared_gpu_problems``); :func:`async_ppo_shape_problems`: the
  checks that combine keys (divisibility of the batch, one size per forward, mode-specific
  keys); :func:`check_async_ppo_config`: both, what the recipe's ``validate_config`` calls.
* :func:`input_problems`: the files: ``output_dir`` and the paths under it, ``checkpoint_path``
  (config.json and every safetensors file complete), the dataset's local files (present,
  non-empty, in their format), the tokenizer against the model's vocabulary, each prompt +
  response budget against the engine's context (:func:`context_problems`), and the checkpoint
  ``resume_from`` names (intact, same number of ranks, before ``total_steps``, or at it when
  the run was killed during its final HF export: :func:`export_left`).

Nothing here builds a model, an engine or a dataset, creates a process group or writes a file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from minippo.config import ConfigError, instantiate, validate
from minippo.config.schema import (
    NO_DEFAULT,
    Anything,
    Bool,
    Component,
    Dtype,
    Float,
    Int,
    Section,
    Spec,
    Str,
    check_schema,
    declared_default,
)
from minippo.engine.quantize import QUANT_FORMATS
from minippo.parallel.distributed import DEFAULT_TIMEOUT_S

log = logging.getLogger(__name__)

# What recipes/async_ppo.py reads. Component nodes list only the arguments checked for a range;
# the others are bound to the callable's signature. Keys: docs/configs.md. A key a config may omit
# states its default here, once; every reader (the recipe, `validate`, `minippo plan`) reads it
# through `setting` (tests/unit/test_config.py finds a default written anywhere else).
ASYNC_PPO_SCHEMA: dict[str, Spec] = {
    "output_dir": Str(),
    "overwrite_output_dir": Bool(default=False),
    "seed": Int(min=0),
    "total_steps": Int(min=1),
    "dtype": Dtype(),
    "activation_checkpointing": Bool(),
    "compile": Bool(default=False),
    "deterministic": Bool(default=False),
    "publish_bucket_mb": Float(gt=0),
    "cpu_threads": Int(min=1, null=True),
    "checkpoint_path": Str(null=True),
    "model": Component(null=True),
    "tokenizer": Component(),
    "dataset": Component({"num_examples": Int(min=1, null=True)}),
    "reward": Component(),
    "engine": Component(
        {
            "dtype": Dtype(),
            "max_batch_size": Int(min=1),
            "quantize": Str(QUANT_FORMATS, null=True),
            "onednn_cache_capacity": Int(min=1),
        }
    ),
    "rollout": Section(
        {
            "mode": Str(("alternate", "overlap"), optional=True),
            "oversample": Float(min=1, default=1.0),
            "offload_trainer": Bool(default=False),
            "share_gpu_with_engine": Bool(default=False),
            "sync_every": Int(min=1, default=1),
            "max_staleness": Int(min=0),
            "partial_rollout": Bool(),
            "groups_per_batch": Int(min=1),
            "samples_per_prompt": Int(min=1),
            "temperature": Float(min=0),
            "top_p": Float(gt=0, max=1),
            "top_k": Int(min=0),
            "max_new_tokens": Int(min=1),
            "stop_at_eos": Bool(),
            "stop_tokens": Anything(optional=True),  # checked against the tokenizer below
        }
    ),
    "correction": Component(null=True, optional=True),
    # multi-turn episodes (docs/multi_turn.md): null = single-turn prompt -> response samples
    "env": Component(null=True, default=None),
    "multi_turn": Section(
        {
            "max_turns": Int(min=1, default=4),
            "max_turn_tokens": Int(min=1, null=True, default=None),  # null: rollout.max_new_tokens
            "step_timeout_s": Float(gt=0, default=30.0),
            "on_error": Str(("raise", "zero_reward"), default="raise"),
            "workers": Int(min=1, default=8),
            "observation_role": Str(default="tool"),
        },
        optional=True,
    ),
    "eval": Section(
        {
            "every_n_steps": Int(min=1, null=True),
            "before_train": Bool(),
            "dataset": Component({"num_examples": Int(min=1, null=True)}),
            "samples_per_prompt": Int(min=1),
            "temperature": Float(min=0, null=True),
            "max_new_tokens": Int(min=1, null=True),
        },
        null=True,
        optional=True,
    ),
    "advantage_estimator": Str(("gae", "grpo")),
    "gae": Section(
        {
            "gamma": Float(min=0, max=1),
            "lam": Float(min=0, max=1),
            "value_lam": Float(min=0, max=1, null=True, default=None),
            "bootstrap_truncated": Bool(),
        }
    ),
    "grpo": Section({"normalize_std": Bool()}),
    "ppo": Section(
        {
            "epochs": Int(min=1),
            "minibatches": Int(min=1),
            "micro_batch_size": Int(min=1, null=True),
            "score_micro_batch_size": Int(min=1, null=True),
            "pack": Bool(default=True),
            "balance_ranks": Bool(default=True),
            "max_tokens_per_micro_batch": Int(min=1, null=True, default=None),
            "score_max_tokens_per_micro_batch": Int(min=1, null=True, default=None),
            "clip_low": Float(min=0, lt=1),
            "clip_high": Float(min=0),
            "dual_clip": Float(gt=1, null=True),
            "entropy_coef": Float(min=0, default=0.0),
            "value_clip": Float(gt=0, null=True),
            "loss_agg_mode": Str(("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")),
            "max_grad_norm": Float(gt=0),
            "max_update_kl": Float(gt=0, null=True, default=None),
            "whiten_advantages": Bool(),
        }
    ),
    "kl": Section(
        {
            "coef": Float(min=0),
            "mode": Str(("reward", "loss")),
            "estimator": Str(("k1", "k2", "k3")),
        }
    ),
    "critic": Section(
        {
            "warmup_steps": Int(min=0),
            "checkpoint_path": Str(null=True),
            "optimizer": Component({"lr": Float(gt=0)}),
        }
    ),
    "optimizer": Component({"lr": Float(gt=0)}),
    "lr_scheduler": Component({"warmup_steps": Int(min=0), "total_steps": Int(min=1, null=True)}),
    "max_consecutive_nonfinite": Int(min=1),
    "checkpoint": Section(
        {
            "dir": Str(),
            "every_n_steps": Int(min=1),
            "keep_last": Int(min=1, null=True),
            "export_hf": Bool(),
        }
    ),
    "resume_from": Str(null=True),
    "metric_logger": Component(),
    "log_every_n_steps": Int(min=1),
    "progress_bar": Bool(),
    "parallel": Section(
        {
            "sharding": Str(("fsdp", "hsdp"), default="fsdp"),
            "shared_output_dir": Bool(default=True),
            "timeout_s": Float(gt=0, default=DEFAULT_TIMEOUT_S),
        },
        optional=True,
    ),
    # read by `minippo plan` only
    "nproc_per_node": Int(min=1, optional=True),
    "nnodes": Int(min=1, optional=True),
    "device": Anything(optional=True),
}

_MISSING = object()


def setting(cfg: Any, key: str) -> Any:
    """The value of the dotted ``key`` in ``cfg``, or the default ``ASYNC_PPO_SCHEMA`` states for it
    when the config omits it (KeyError for a key without a declared default)."""
    value = OmegaConf.select(cfg, key, default=_MISSING)
    return declared_default(ASYNC_PPO_SCHEMA, key) if value is _MISSING else value


def section(cfg: Any, name: str) -> dict[str, Any]:
    """A section's keys as plain (resolved) values, each omitted key at its declared default."""
    keys = ASYNC_PPO_SCHEMA[name].keys
    defaults = {k: spec.default for k, spec in keys.items() if spec.default is not NO_DEFAULT}
    return defaults | OmegaConf.to_container(cfg[name], resolve=True)


_FILE_FORMATS = ("json", "jsonl", "parquet", "csv", "text", "arrow")
_ROW_FORMATS = ("json", "jsonl", "parquet", "csv")  # whose first row preflight reads
# Set by `minippo run` in the ranks it launches: the launcher of their node ran these checks and
# printed their warnings, so the ranks repeat the checks without printing them again.
LAUNCHER_CHECKED_ENV = "MINIPPO_LAUNCHER_CHECKED"


def raise_problems(problems: list[str]) -> None:
    """Raise one ConfigError listing ``problems`` (nothing when the list is empty)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        text = "\n  ".join(problems)
        raise ConfigError(f"{len(problems)} problems in the config:\n  {text}", problems)


def config_problems(cfg: DictConfig, schema: dict[str, Spec], world_size: int = 1) -> list[str]:
    """Keys, types and ranges (``schema``), every ``_component_`` (imports, signature) and, for a
    config with a ``rollout`` section, the correction contract and the rollout.mode of an SGLang
    engine on the trainer's GPU (``minippo.plan.shared_gpu_problems``, planned on ``world_size``
    ranks); one line per problem."""
    problems = check_schema(cfg, schema)
    problems += [p for p in validate(cfg) if p not in problems]
    if not problems and "rollout" in cfg:  # the contract reads well-typed rollout keys
        from minippo.plan import shared_gpu_problems
        from minippo.rl.correction import validate_async_off_policy_correction

        try:
            with warnings.catch_warnings():
                if os.environ.get(LAUNCHER_CHECKED_ENV) == "1":
                    warnings.simplefilter("ignore")  # printed once by this node's launcher
                validate_async_off_policy_correction(cfg)
        except ValueError as e:
            problems.append(str(e))
        problems += shared_gpu_problems(cfg, world_size=world_size)
    return problems


def multi_turn_problems(cfg: DictConfig, budget_key: str = "rollout.max_new_tokens") -> list[str]:
    """The budgets of multi-turn episodes (``env`` set) that cannot hold: a per-turn cap above
    the whole response budget (``budget_key``: model and observation tokens), more turns than
    the budget has tokens; ``multi_turn`` keys set without an ``env``."""
    budget = OmegaConf.select(cfg, budget_key)
    if setting(cfg, "env") is None:
        set_keys = sorted(OmegaConf.select(cfg, "multi_turn", default=None) or {})
        if set_keys:
            return [
                f"multi_turn.{set_keys[0]} is set but env is null (single-turn samples): set "
                "env._component_ to an environment class, or remove the multi_turn section"
            ]
        return []
    problems = []
    cap, turns = setting(cfg, "multi_turn.max_turn_tokens"), setting(cfg, "multi_turn.max_turns")
    if cap is not None and budget is not None and cap > budget:
        problems.append(
            f"multi_turn.max_turn_tokens ({cap}) exceeds {budget_key} ({budget}), the budget "
            f"of the whole response (model and observation tokens); set "
            f"multi_turn.max_turn_tokens<={budget} or raise {budget_key}"
        )
    if budget is not None and turns > budget:
        problems.append(
            f"{budget_key} ({budget}) cannot hold multi_turn.max_turns ({turns}) model turns of "
            f"one token each; set multi_turn.max_turns<={budget} or raise {budget_key}"
        )
    return problems


def check_async_ppo_config(cfg: DictConfig, world_size: int, distributed: bool = True) -> None:
    """Raise one ConfigError with every problem of an async PPO config that needs no model: the
    keys, types and ranges of :data:`ASYNC_PPO_SCHEMA`, the components and the correction
    contract (:func:`config_problems`), then, once those hold, :func:`async_ppo_shape_problems`.
    ``distributed``: the run has a process group (under torchrun)."""
    raise_problems(config_problems(cfg, ASYNC_PPO_SCHEMA, world_size=world_size))
    raise_problems(async_ppo_shape_problems(cfg, world_size, distributed))


def async_ppo_shape_problems(cfg: DictConfig, world_size: int, distributed: bool) -> list[str]:
    """The checks of a well-typed async PPO config that combine keys (its shapes), each with its
    values and a fix: GRPO groups of at least 2, ``groups_per_batch`` divisible by the ranks,
    rows per rank by ``ppo.minibatches``, minibatch rows by ``ppo.micro_batch_size``, one size
    per forward (rows or a token budget, which needs ``ppo.pack``), k1 as a KL loss, critic
    warm-up steps, the keys of one ``rollout.mode`` used with the other, ``rollout.sync_every``
    against eval, a non-fp32 ``dtype`` without a process group, ``dtype: fp32`` on CUDA
    (:func:`dtype_device_problem`; the trainer's device is CUDA wherever torch sees a GPU)."""
    from omegaconf import OmegaConf

    from minippo.config import canonical_dtype
    from minippo.rl import needs_critic
    from minippo.training.placement import rollout_mode

    problems: list[str] = []
    r, ppo, est = cfg.rollout, cfg.ppo, cfg.advantage_estimator
    if est == "grpo" and r.samples_per_prompt < 2:
        problems.append(
            f"advantage_estimator=grpo compares samples of one prompt: rollout.samples_per_prompt "
            f"({r.samples_per_prompt}) must be >= 2"
        )
    if r.groups_per_batch % world_size:
        problems.append(
            f"rollout.groups_per_batch ({r.groups_per_batch}) must be divisible by the number of "
            f"ranks ({world_size}); set rollout.groups_per_batch="
            f"{max(world_size, r.groups_per_batch // world_size * world_size)}"
        )
    rows = r.groups_per_batch // world_size * r.samples_per_prompt  # rows per rank per step
    if rows % ppo.minibatches:
        problems.append(
            f"rows per rank ({rows} = groups_per_batch {r.groups_per_batch} / {world_size} ranks x "
            f"samples_per_prompt {r.samples_per_prompt}) must be divisible by ppo.minibatches "
            f"({ppo.minibatches}); pick ppo.minibatches among "
            f"{[d for d in range(1, rows + 1) if rows % d == 0]}"
        )
    elif ppo.micro_batch_size is not None and (mb_rows := rows // ppo.minibatches) % (
        ppo.micro_batch_size
    ):
        divisors = [d for d in range(1, mb_rows + 1) if mb_rows % d == 0]
        problems.append(
            f"minibatch rows ({mb_rows}) must be divisible by ppo.micro_batch_size "
            f"({ppo.micro_batch_size}); pick one of {divisors}"
            " or null (the whole minibatch in one forward)"
        )
    for rows_key, tokens_key in (
        ("micro_batch_size", "max_tokens_per_micro_batch"),
        ("score_micro_batch_size", "score_max_tokens_per_micro_batch"),
    ):
        if ppo.get(rows_key) is not None and ppo.get(tokens_key) is not None:
            problems.append(
                f"ppo.{rows_key} ({ppo[rows_key]}) and ppo.{tokens_key} ({ppo[tokens_key]}) "
                f"both size the same forwards; set one of them to null"
            )
        elif ppo.get(tokens_key) is not None and not setting(cfg, "ppo.pack"):
            problems.append(
                f"ppo.{tokens_key} ({ppo[tokens_key]}) counts real tokens, which bound a "
                f"forward only when it computes on them: set ppo.pack=true, or ppo.{rows_key} "
                "for padded forwards"
            )
    if cfg.kl.coef > 0 and cfg.kl.mode == "loss" and cfg.kl.estimator == "k1":
        problems.append(
            "kl.estimator=k1 with kl.mode=loss has zero expected gradient (E_π[∇log π] = 0); "
            "set kl.estimator=k2 (gradient of KL(π‖π_ref)) or k3 (gradient of KL(π_ref‖π))"
        )
    if needs_critic(est) and cfg.critic.warmup_steps >= cfg.total_steps:
        problems.append(
            f"critic.warmup_steps ({cfg.critic.warmup_steps}) must be in [0, total_steps "
            f"({cfg.total_steps}))"
        )
    if rollout_mode(cfg) == "overlap":
        for key in ("oversample", "offload_trainer"):
            value = declared_default(ASYNC_PPO_SCHEMA, f"rollout.{key}")
            if setting(cfg, f"rollout.{key}") != value:
                problems.append(
                    f"rollout.{key}={r[key]} needs rollout.mode=alternate (generation between "
                    f"training steps); set rollout.mode=alternate or rollout.{key}={value}"
                )
    sync_every = setting(cfg, "rollout.sync_every")
    if rollout_mode(cfg) == "alternate":
        if sync_every > 1:
            problems.append(
                f"rollout.sync_every={sync_every} needs rollout.mode=overlap: alternate puts the "
                "engine to sleep after every batch (its weights are released) and wakes it only "
                "to take new weights; set rollout.sync_every=1 or rollout.mode=overlap"
            )
        if setting(cfg, "rollout.oversample") > 1 and r.max_staleness == 0:
            problems.append(
                f"rollout.oversample={r.oversample} carries groups into the next step, and with "
                "rollout.max_staleness=0 every carried token is too old: all of them would restart "
                "each step; set rollout.max_staleness>=1 or rollout.oversample=1.0"
            )
    problems += multi_turn_problems(cfg)
    every = OmegaConf.select(cfg, "eval.every_n_steps", default=None)
    if every is not None and cfg.total_steps % sync_every:
        problems.append(
            f"total_steps ({cfg.total_steps}) must be a multiple of rollout.sync_every "
            f"({sync_every}) when eval is set: the final validation runs on the engines right "
            "after the last publish; set total_steps="
            f"{max(sync_every, cfg.total_steps // sync_every * sync_every)}"
        )
    if every is not None and every % sync_every:
        problems.append(
            f"eval.every_n_steps ({every}) must be a multiple of rollout.sync_every "
            f"({sync_every}): validation runs on the engines right after a publish, when they "
            "hold the actor's weights; set eval.every_n_steps="
            f"{max(sync_every, every // sync_every * sync_every)}"
        )
    if canonical_dtype(cfg.dtype, "dtype") != "float32" and not distributed:
        problems.append(
            f"dtype={cfg.dtype} is FSDP2 mixed precision (fp32 master weights), which needs a "
            "process group: run `minippo run --nproc-per-node 1 async_ppo ...`, or set dtype=fp32"
        )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    attention = None
    if device == "cuda" and canonical_dtype(cfg.dtype, "dtype") == "float32":
        attention = fp32_attention_bytes(cfg, world_size)
    problem = dtype_device_problem(device, cfg.dtype, attention)
    if problem is not None:
        problems.append(problem)
    return problems


# fp32 attention on CUDA (SDPA's math kernel) is allowed while the attention matrices it keeps
# for one training forward stay below this: the tiny configs on a GPU (a few MiB), not a real model
FP32_CUDA_ATTENTION_LIMIT = 1 << 30


def fp32_attention_bytes(cfg: DictConfig, world_size: int = 1) -> int | None:
    """Upper bound of the fp32 attention probabilities SDPA's math kernel keeps for backward in one
    training forward: n_layers · H · T · S · 4 bytes (T tokens per forward, S the longest sequence:
    a query attends to at most S keys of its sequence); None when the model's shape cannot be read
    from the config (``minippo.plan.plan_inputs_from_config``)."""
    from minippo.config import ConfigError
    from minippo.plan import plan_inputs_from_config

    try:
        x = plan_inputs_from_config(cfg, world_size=world_size, device="cuda")
    except (ConfigError, OSError, ValueError):
        return None
    return x.actor.n_layers * x.actor.n_heads * x.train_tokens * x.seq_len * 4


def dtype_device_problem(
    device_type: str, dtype: str, attention_bytes: int | None = None
) -> str | None:
    """The one-line reason the trainer cannot train in ``dtype`` on ``device_type``, or None.

    The trainer computes in ``dtype`` on every path (one plain process: unsharded fp32; FSDP2:
    fp32 master weights, ``dtype`` compute). On CUDA its attention (``models/packing.py``,
    ``models/model.py``) has fast kernels for bf16/fp16 only (flash attention); in fp32 it falls
    to SDPA's math kernel with grouped-query heads, which materialises every attention matrix and
    keeps it for backward. ``attention_bytes`` (:func:`fp32_attention_bytes`): those matrices for
    one training forward; fp32 on CUDA is refused when they exceed FP32_CUDA_ATTENTION_LIMIT
    (1 GiB) or are unknown (None). The tiny configs stay allowed on a GPU (the trainer runs
    there wherever torch sees one); fp32 on the CPU is the tested path of the CPU configs."""
    from minippo.config import canonical_dtype

    if device_type != "cuda" or canonical_dtype(dtype, "dtype") != "float32":
        return None
    if attention_bytes is not None and attention_bytes <= FP32_CUDA_ATTENTION_LIMIT:
        return None
    size = "of unknown size" if attention_bytes is None else f"{attention_bytes / 2**30:.1f} GiB"
    return (
        f"dtype={dtype} on a CUDA device: the trainer's fp32 attention has no fast CUDA kernel; "
        f"SDPA's math kernel keeps every attention matrix for backward ({size} per training "
        "forward, more than 1 GiB: slow, may run out of memory); set dtype=bf16 (fp32 master "
        "weights under FSDP2), or train on the CPU with CUDA_VISIBLE_DEVICES=''"
    )


def check_inputs(cfg: DictConfig, world_size: int = 1, local_world_size: int | None = None) -> None:
    """Raise one ConfigError with every problem of :func:`input_problems`."""
    raise_problems(input_problems(cfg, world_size, local_world_size))


def input_problems(
    cfg: DictConfig, world_size: int = 1, local_world_size: int | None = None
) -> list[str]:
    """Every problem with the files a run reads or writes (see the module docstring); keys the
    config does not have are skipped. ``local_world_size``: ranks per node (None:
    ``$LOCAL_WORLD_SIZE``, else ``world_size``), which with ``parallel.sharding`` gives the layout
    a checkpoint to resume must have."""
    problems: list[str] = []
    problems += _output_problems(cfg)
    args = None
    for key in ("checkpoint_path", "critic.checkpoint_path"):
        path = _get(cfg, key)
        if key.startswith("critic") and (path is None or path == _get(cfg, "checkpoint_path")):
            continue
        if path is not None:
            try:
                from minippo.models.hf_checkpoint import check_hf_folder

                found = check_hf_folder(path)
                args = found if key == "checkpoint_path" else args
            except (OSError, ValueError) as e:
                problems.append(f"{key}={path}: {e}" + _latest_hint(path))
    if _get(cfg, "checkpoint_path") is None and "model" in cfg and cfg.model is None:
        problems.append(
            "checkpoint_path and model are both null: set checkpoint_path to an HF folder, or "
            "model to a size builder (e.g. model._component_=minippo.models.qwen3_tiny)"
        )
    problems += _dataset_problems(cfg, "dataset")
    problems += _dataset_problems(cfg, "eval.dataset")
    if not problems:
        problems += _vocab_problems(cfg, args)
    if not problems:
        problems += context_problems(cfg, args)
    problems += _resume_problems(cfg, world_size, local_world_size)
    return problems


def _latest_hint(path: Any) -> str:
    """For a path through a run folder's ``latest`` link that is not there yet."""
    parts = Path(str(path)).parts
    if "latest" not in parts:
        return ""
    link = Path(*parts[: parts.index("latest") + 1])
    if link.exists():
        return ""
    return (
        f" ({link} is written when a run of the config whose folder it is ends well: run that "
        "first, or give the folder of a run)"
    )


def warn_if_prompts_cycle(num_prompts: int, groups_per_batch: int) -> None:
    """Say that a batch repeats prompts when the dataset has fewer than a batch needs."""
    if num_prompts < groups_per_batch:
        log.warning(
            "the dataset has %d prompts, fewer than rollout.groups_per_batch=%d: the prompt "
            "stream cycles through it (reshuffled each epoch), so every batch repeats prompts",
            num_prompts,
            groups_per_batch,
        )


def warn_if_oversample_waits(rows_in_flight: int, groups: int, max_batch_size: int) -> None:
    """``rollout.mode: alternate`` with TorchEngine, which decodes waves of at most
    ``engine.max_batch_size`` rows, each to its end: rows beyond the first wave start only after
    it, so over-provisioned groups there are never stopped part-way (no partial rollouts)."""
    if rows_in_flight > max_batch_size:
        log.warning(
            "rollout.oversample holds %d rows (%d groups) in flight per rank but "
            "engine.max_batch_size=%d: TorchEngine decodes waves of that many rows, so the rows "
            "past the first wave wait for it and the extra groups carry no partial tokens; set "
            "engine.max_batch_size=%d",
            rows_in_flight,
            groups,
            max_batch_size,
            rows_in_flight,
        )


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return default
        node = node[part]
    return node


def _output_problems(cfg: DictConfig) -> list[str]:
    problems = []
    out = _get(cfg, "output_dir")
    if isinstance(out, str):
        path = Path(out).expanduser()
        if path.exists() and not path.is_dir():
            problems.append(f"output_dir={out} is a file, not a folder; choose another output_dir")
        elif not path.exists() and _first_existing(path).is_file():
            problems.append(
                f"output_dir={out} lies under the file {_first_existing(path)}; choose another "
                "output_dir"
            )
    if not problems and isinstance(out, str) and os.environ.get("RANK", "0") == "0":
        from minippo.training.output_dir import OutputDir  # what rank 0's claim will refuse

        problems += OutputDir.of_run(cfg).problems()
    ckpt = _get(cfg, "checkpoint.dir")
    if isinstance(ckpt, str) and Path(ckpt).expanduser().is_file():
        problems.append(f"checkpoint.dir={ckpt} is a file, not a folder; choose another folder")
    metrics = _get(cfg, "metric_logger.path")
    if isinstance(metrics, str) and Path(metrics).expanduser().is_dir():
        problems.append(
            f"metric_logger.path={metrics} is a folder; give a file path (e.g. "
            f"{Path(metrics) / 'metrics.jsonl'})"
        )
    return problems


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _dataset_problems(cfg: DictConfig, key: str) -> list[str]:
    """The local data files of the dataset component at ``key`` (present, non-empty, in their
    format)."""
    node = _get(cfg, key)
    if not isinstance(node, DictConfig) or node.get("data_files") is None:
        return []
    source = node.get("source")
    if source not in _FILE_FORMATS:
        return []
    files = node.data_files
    files = [files] if isinstance(files, str) else list(files)
    problems, first = [], None
    for pattern in files:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        first = first or (matches[0] if matches else None)
        if not matches:
            problems.append(
                f"{key}.data_files: {pattern} does not exist; give the path of a {source} file"
            )
        for file in matches:
            why = _data_file_problem(Path(file), source)
            if why:
                problems.append(f"{key}.data_files: {file} {why}")
    if not problems and first:  # the loader reads the first row's fields before anything else
        problems += _field_problems(node, key, Path(first), source)
    return problems


def _field_problems(node: DictConfig, key: str, file: Path, source: str) -> list[str]:
    """``prompt_key`` and ``answer_key`` of ``load_prompt_dataset`` against the first row of its
    first data file (json lines, a parquet or a csv file), in the loader's words."""
    component = str(node.get("_component_", ""))
    if not component.endswith("load_prompt_dataset") or source not in _ROW_FORMATS:
        return []
    from minippo.data.loading import _get as get_field

    row = _first_row(file, source)
    if not isinstance(row, dict):
        return []
    problems = []
    for role, default in (("prompt_key", "question"), ("answer_key", "answer")):
        try:
            get_field(row, str(node.get(role, default)), role, f"the rows of {file}")
        except ValueError as e:
            problems.append(f"{key}.{e}")
    return problems


def _first_row(file: Path, source: str) -> Any:
    """The first row of a data file, or None when it cannot be read cheaply."""
    try:
        if source == "parquet":
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(file).iter_batches(batch_size=1), None)
            return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
        if source == "csv":
            import csv

            with open(file, encoding="utf-8", newline="") as f:
                return next(csv.DictReader(f), None)
        with open(file, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            return json.loads(first)
        except json.JSONDecodeError:
            doc = json.loads(file.read_text(encoding="utf-8"))
            return doc[0] if isinstance(doc, list) and doc else doc
    except Exception:  # the loader reports what it cannot read
        return None


def _data_file_problem(file: Path, source: str) -> str | None:
    """What is wrong with a local data file of format ``source``, or None."""
    if file.is_dir():
        return "is a folder; give the data files themselves (a glob such as dir/*.parquet works)"
    size = file.stat().st_size
    if size == 0:
        return "is empty: it has no rows"
    if source == "parquet":
        with open(file, "rb") as f:
            head = f.read(4)
            f.seek(max(0, size - 4))
            tail = f.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            return "is not a complete parquet file (corrupt or truncated)"
    if source in ("json", "jsonl"):
        with open(file, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        if not first.strip():
            return "is empty: it has no rows"
        try:
            json.loads(first)
        except json.JSONDecodeError as e:
            if first.lstrip()[:1] not in "[{" or size > 256 * 2**20:
                return f"is not JSON lines (line 1: {e.msg}); each line must be one JSON object"
            try:  # one JSON document over several lines
                json.loads(file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e2:
                return f"is neither JSON lines nor a JSON document ({e2}); corrupt or truncated?"
    return None


def _vocab_problems(cfg: DictConfig, args: Any) -> list[str]:
    """The tokenizer against the model's vocabulary (both are cheap to build)."""
    if "tokenizer" not in cfg or not isinstance(cfg.tokenizer, DictConfig):
        return []
    try:
        if args is None:
            if _get(cfg, "model") is None:
                return []
            args = instantiate(cfg.model)
        tokenizer = instantiate(cfg.tokenizer)
    except (OSError, ValueError, TypeError) as e:
        return [f"cannot build the tokenizer or the model config: {e}"]
    try:  # async_ppo's rollout.stop_tokens, eval's sampling.stop_tokens
        for key in ("rollout.stop_tokens", "sampling.stop_tokens"):
            stop_ids(tokenizer, _get(cfg, key), stop_at_eos=False, key=key)
    except ValueError as e:
        return [str(e)]
    model_v, tok_v = int(args.vocab_size), int(tokenizer.vocab_size)
    if model_v < tok_v:
        return [
            f"the model's vocab_size ({model_v}) is smaller than the tokenizer's ({tok_v}): the "
            f"tokenizer's ids would not fit the embedding; set model.vocab_size={tok_v}"
        ]
    if model_v > tok_v and _get(cfg, "checkpoint_path") is None:
        return [
            f"the model's vocab_size ({model_v}) is larger than the tokenizer's ({tok_v}): a "
            f"randomly initialised model samples ids the tokenizer cannot decode; set "
            f"model.vocab_size={tok_v}"
        ]
    return []


# (key of a response budget, the dataset whose prompts it follows, the key it defaults to)
_BUDGETS = (
    ("rollout.max_new_tokens", "dataset", None),
    ("eval.max_new_tokens", "eval.dataset", "rollout.max_new_tokens"),  # eval: null = rollout's
    ("sampling.max_new_tokens", "dataset", None),  # recipes/eval.py
)


def context_problems(
    cfg: DictConfig, args: Any = None, prompt_tokens: dict[str, int] | None = None
) -> list[str]:
    """Every response budget against the engine's context: ``len(prompt) + max_new_tokens`` must
    fit ``engine.context_length`` when the config sets it, else the model's ``max_seq_len`` (an
    HF checkpoint's ``max_position_embeddings``), which the engine would refuse only once the
    first request reaches it.

    ``args``: the model's ModelArgs (None: built from ``model``). ``prompt_tokens``: the longest
    prompt of each dataset key (``"dataset"``, ``"eval.dataset"``), known once the datasets are
    built; without it a dataset's ``max_prompt_tokens`` bounds its prompts, else 1 token (the
    shortest prompt) does.
    """
    if args is None:
        if _get(cfg, "model") is None or _get(cfg, "checkpoint_path") is not None:
            return []  # no model to read; an HF folder's config is read by input_problems
        try:
            args = instantiate(cfg.model)
        except (OSError, ValueError, TypeError) as e:
            return [f"cannot build the model config: {e}"]
    if _get(cfg, "engine.context_length") is not None:
        context, where = int(_get(cfg, "engine.context_length")), "engine.context_length"
    else:
        context = int(args.max_seq_len)
        where = (
            "the max_position_embeddings of checkpoint_path"
            if _get(cfg, "checkpoint_path") is not None
            else "model.max_seq_len"
        )
    problems = []
    for key, dataset, fallback in _BUDGETS:
        budget = _get(cfg, key)
        if budget is None and fallback is not None and _get(cfg, dataset.rsplit(".", 1)[0]):
            budget = _get(cfg, fallback)
        if not isinstance(budget, int) or isinstance(budget, bool):
            continue  # absent, or its type is the schema's to report
        if prompt_tokens is not None and dataset in prompt_tokens:
            prompt, what = prompt_tokens[dataset], f"the longest prompt of {dataset}"
        elif isinstance(_get(cfg, f"{dataset}.max_prompt_tokens"), int):
            prompt = _get(cfg, f"{dataset}.max_prompt_tokens")
            what = f"{dataset}.max_prompt_tokens"
        else:
            prompt, what = 1, "a prompt of at least"
        if prompt + budget > context:
            problems.append(
                f"{key}={budget} plus {what} {prompt} token{'s' * (prompt != 1)} exceeds the "
                f"engine's context of {context} tokens ({where}); set {key} to at most "
                f"{max(context - prompt, 0)}"
            )
    return problems


def longest_prompt(dataset: Any) -> int:
    """The longest prompt of a built dataset (a sequence of prompt items), in tokens."""
    from minippo.training.rollout_queue import prompt_ids_of

    return max((len(prompt_ids_of(item)) for item in dataset), default=0)


def stop_ids(
    tokenizer: Any, stop_tokens: Any, *, stop_at_eos: bool, key: str = "rollout.stop_tokens"
) -> tuple[int, ...]:
    """The token ids that end a response: the tokenizer's EOS ids when ``stop_at_eos``, then the
    id of each string of ``stop_tokens`` (the config value at ``key``: null or a list of strings,
    each one token of the tokenizer, e.g. ``["</answer>"]``); a ValueError naming ``key``
    otherwise."""
    ids = list(tokenizer.eos_ids) if stop_at_eos else []
    if stop_tokens is None:
        return tuple(ids)
    fix = f'e.g. {key}=["}}"] (strings the tokenizer encodes to one token each)'
    is_list = isinstance(stop_tokens, Sequence) and not isinstance(stop_tokens, str)
    if not is_list or not all(isinstance(t, str) for t in stop_tokens):
        raise ValueError(f"{key} must be null or a list of strings; {fix}")
    for text in stop_tokens:
        encoded = list(tokenizer.encode(text))
        if len(encoded) != 1:
            raise ValueError(
                f"{key}: {text!r} encodes to {len(encoded)} tokens {encoded}, not one; {fix}"
            )
        ids += [int(t) for t in encoded if int(t) not in ids]
    return tuple(ids)


def _resume_problems(cfg: DictConfig, world_size: int, local_world_size: int | None) -> list[str]:
    resume = _get(cfg, "resume_from")
    if resume in (None, "", "null") or _get(cfg, "checkpoint.dir") is None:
        return []
    from minippo.parallel.mesh import shard_ranks, sharding_of
    from minippo.training.checkpoint import (
        Checkpointer,
        layout_hint,
        read_meta,
        saved_shard_ranks,
    )

    checkpointer = Checkpointer(Path(cfg.checkpoint.dir).expanduser())
    try:
        path = checkpointer.resolve(resume)
        meta = read_meta(path) or checkpointer.verify(path)
        if meta["world_size"] != world_size:
            return [
                f"checkpoint {path} was written by {meta['world_size']} ranks but this run has "
                f"{world_size}; resume with {layout_hint(meta)}"
            ]
        meta = checkpointer.verify(path)
        split = shard_ranks(sharding_of(cfg), world_size, local_world_size) if world_size > 1 else 1
        if saved_shard_ranks(meta) != split:
            return [
                f"checkpoint {path} was written with parameters split over "
                f"{saved_shard_ranks(meta)} ranks, this run would split them over {split} "
                f"(parallel.sharding={sharding_of(cfg)}); resume with {layout_hint(meta)}"
            ]
    except (OSError, ValueError) as e:
        return [str(e)]
    problems = []
    if "config" in meta:  # the resolved config the checkpoint trained with
        from minippo.training.resume_settings import changed_settings

        changed = changed_settings(meta["config"], OmegaConf.to_container(cfg, resolve=True))
        if changed:
            problems.append(
                f"resume_from={resume}: this run changes what checkpoint {path} trained "
                f"({'; '.join(changed[:4])}{'; ...' if len(changed) > 4 else ''}); resume with "
                "the same settings, or start a new run (what may change on resume: "
                "docs/recipe.md, 'What a resume may change')"
            )
    total = _get(cfg, "total_steps")
    if isinstance(total, int) and meta["step"] >= total and not export_left(cfg, meta["step"]):
        problems.append(
            f"checkpoint {path} is at step {meta['step']}, but total_steps is {total}; raise "
            "total_steps to continue training"
        )
    return problems


def export_left(cfg: DictConfig, step: int) -> bool:
    """Whether a run resumed at ``step == total_steps`` still has its HF export to write: the run
    was killed during the export (``checkpoint.export_hf`` on, and ``output_dir/hf_export`` holds
    no complete export of that step). Such a resume trains nothing and only exports."""
    if step != _get(cfg, "total_steps") or not _get(cfg, "checkpoint.export_hf"):
        return False
    from minippo.parallel.fsdp import exported_step

    export = Path(str(_get(cfg, "output_dir"))).expanduser() / "hf_export"
    return exported_step(export) != step
