"""Plan inputs from a run config: the recipe's keys, and the defaults of the components it names.

Each input is read from the one config key the recipe reads (``ppo.micro_batch_size``,
``rollout.max_new_tokens``, ...); what a key leaves to a component is asked from the component:

    critic or not          minippo.rl.advantages.needs_critic(advantage_estimator)
    dtype bytes            minippo.config.dtype_bytes(dtype)
    correction             the class named by correction._component_: ``stored_weights(...)``
                           and ``scoring_passes(...)`` with the node's options (the class fills
                           its own defaults); an absent node is NoCorrection, as in the recipe
    engine                 options the node omits (mem_fraction_static, memory_mode,
                           weights_cpu_backup; TorchEngine's device, dtype, max_batch_size,
                           in_process) take the engine class's signature defaults
    rollout mode           rollout.mode (absent: "overlap", the recipe's default) decides whether
                           the engine's share is alive while the trainer trains;
                           rollout.offload_trainer (absent: false) only counts in alternate mode
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from minippo.config import ConfigError, dtype_bytes, locate
from minippo.models.logprobs import DEFAULT_CHUNK_SIZE
from minippo.plan.formula import (
    CorrectionCost,
    GiB,
    MemoryPlan,
    PlanInputs,
    TorchEngineShape,
    forward_tokens,
    plan_memory,
)
from minippo.rl.advantages import needs_critic
from minippo.rl.correction.base import WeightCopies
from minippo.training.optimizers import optimizer_spec
from minippo.training.placement import rollout_mode, sglang_on_gpu
from minippo.training.preflight import setting

__all__ = [
    "DEFAULT_GPU_MEM_GIB",
    "MASTER_DTYPE",
    "NO_CORRECTION",
    "correction_cost",
    "engine_options",
    "plan_from_config",
    "plan_inputs_from_config",
    "rollout_mode",
]

# One GPU's memory when the caller gives none (``minippo plan``'s default too).
DEFAULT_GPU_MEM_GIB = 80.0
# The recipe builds every model in fp32 and trains either unsharded in fp32 (one process) or with
# FSDP2 mixed precision over those fp32 master weights (``dtype`` is the compute dtype).
MASTER_DTYPE = "fp32"
# What the recipe builds when the config has no correction node (``build_correction``).
NO_CORRECTION = "minippo.rl.correction.NoCorrection"
# Datasets cheap enough to build to find their longest prompt.
TOY_DATASETS = "minippo.data.tasks."

_REQUIRED = object()


def _select(cfg: DictConfig, key: str, default: Any = _REQUIRED) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ConfigError(
            f"memory plan: the config has no {key}; add it (the recipe reads it), e.g. "
            f"minippo plan --config ... +{key}=..."
        )
    return default


# The size builders of minippo.models, by the name of the released checkpoint folder they match.
SIZE_BUILDERS = (
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen2_5_0_5b",
    "llama3_2_1b",
)


def builder_for_folder(path: Any) -> str | None:
    """The size builder whose name matches an HF folder's name ("Qwen3-0.6B" -> qwen3_0_6b)."""
    name = Path(str(path)).name.lower().replace("-", "_").replace(".", "_")
    name = name.replace("llama_3_2", "llama3_2")
    return name if name in SIZE_BUILDERS else None


_NOT_DOWNLOADED_TOLD: set[tuple[str, str]] = set()  # folders the notice below named already


def _args_from_hf_folder(path: Any, key: str) -> Any:
    """ModelArgs from ``path/config.json``; when the folder is not downloaded yet but its name is
    a released size (``/models/Qwen3-0.6B``), from that size's builder, saying so."""
    from minippo import models
    from minippo.models import model_args_from_hf_config

    cfg_file = Path(str(path)) / "config.json"
    if cfg_file.is_file():
        return model_args_from_hf_config(json.loads(cfg_file.read_text()))
    builder = builder_for_folder(path)
    if builder is not None:
        if (str(path), builder) in _NOT_DOWNLOADED_TOLD:  # the critic's, or a second plan
            return getattr(models, builder)()
        _NOT_DOWNLOADED_TOLD.add((str(path), builder))
        print(
            f"memory plan: {key}={path} is not downloaded; planning the shape of "
            f"minippo.models.{builder}, the size its name gives",
            file=sys.stderr,
        )
        return getattr(models, builder)()
    raise ConfigError(
        f"memory plan: {key}={path!r} has no config.json (only config.json is read, no "
        "weights); download the model there, or plan from a size builder instead: "
        f"{key}=null 'model={{_component_: minippo.models.<size>}}' with <size> one of "
        f"{', '.join(SIZE_BUILDERS)}"
    )


def _args_from_builder(node: Any, key: str) -> Any:
    """ModelArgs from a zero-argument size builder node (``_component_: minippo.models.qwen3_4b``,
    keyword overrides allowed)."""
    from minippo.models import ModelArgs

    if not isinstance(node, DictConfig) or "_component_" not in node:
        raise ConfigError(
            f"memory plan: cannot get the model shape from {key}={node!r}; give a size builder "
            "(_component_: minippo.models.qwen3_4b) or checkpoint_path (an HF folder)"
        )
    target = locate(node["_component_"], f"{key}._component_")
    kwargs = {k: v for k, v in node.items() if k != "_component_"}
    try:
        out = target(**kwargs)
    except TypeError as e:
        raise ConfigError(f"memory plan: {key}: calling {node['_component_']} failed: {e}") from e
    if not isinstance(out, ModelArgs):
        raise ConfigError(
            f"memory plan: {key}._component_={node['_component_']} returned "
            f"{type(out).__name__}, not ModelArgs; cannot get the model shape; use a size builder "
            "such as minippo.models.qwen3_4b"
        )
    return out


def _prompt_len(cfg: DictConfig) -> int:
    """The padded prompt length: ``dataset.max_prompt_tokens``, or, for the built-in toy tasks
    (cheap to build), the longest prompt of the dataset itself."""
    value = _select(cfg, "dataset.max_prompt_tokens", None)
    if value is not None:
        return int(value)
    comp = str(OmegaConf.select(cfg, "dataset._component_", default="") or "")
    if comp.startswith(TOY_DATASETS) and "tokenizer" in cfg:
        from minippo.config import instantiate

        dataset = instantiate(cfg.dataset, tokenizer=instantiate(cfg.tokenizer))
        return int(dataset.max_prompt_len())
    raise ConfigError(
        "memory plan: the config has no dataset.max_prompt_tokens; set it (the loader drops "
        "longer prompts), e.g. minippo plan --config ... +dataset.max_prompt_tokens=1024"
    )


def _micro_batch_rows(cfg: DictConfig, world_size: int, seq_len: int) -> int:
    """Rows per training forward: ``ppo.micro_batch_size``; with a token budget
    (``ppo.max_tokens_per_micro_batch``) the sequences of the longest length ``seq_len`` it holds
    (at least 1); both null: this rank's minibatch (groups_per_batch · samples_per_prompt / ranks
    / ppo.minibatches), which the recipe then trains in one forward."""
    rows = OmegaConf.select(cfg, "ppo.micro_batch_size", default=_REQUIRED)
    if rows is _REQUIRED:
        _select(cfg, "ppo.micro_batch_size")  # the key is missing: its error
    if rows is not None:
        return int(rows)
    tokens = setting(cfg, "ppo.max_tokens_per_micro_batch")
    if tokens is not None:
        return forward_tokens(tokens, seq_len) // seq_len
    groups = int(_select(cfg, "rollout.groups_per_batch"))
    samples = int(_select(cfg, "rollout.samples_per_prompt"))
    return max(1, groups * samples // world_size // int(_select(cfg, "ppo.minibatches")))


def _score_rows(cfg: DictConfig, world_size: int, seq_len: int) -> int:
    """Sequences per no-grad forward: ``ppo.score_micro_batch_size`` when the config has it; with
    a token budget (``ppo.score_max_tokens_per_micro_batch``) the sequences of the longest length
    it holds; else this rank's whole batch (groups_per_batch · samples_per_prompt / ranks), which
    is what the recipe scores in one forward."""
    rows = _select(cfg, "ppo.score_micro_batch_size", None)
    if rows is not None:
        return int(rows)
    tokens = setting(cfg, "ppo.score_max_tokens_per_micro_batch")
    if tokens is not None:
        return forward_tokens(tokens, seq_len) // seq_len
    groups = int(_select(cfg, "rollout.groups_per_batch"))
    samples = int(_select(cfg, "rollout.samples_per_prompt"))
    return max(1, groups * samples // world_size)


def _interface(cls: type, name: str, component: str) -> Any:
    fn = getattr(cls, name, None)
    if not callable(fn):
        raise ConfigError(
            f"memory plan: correction._component_={component} has no {name}(...) classmethod; "
            "the plan reads what a correction stores and scores from its class (see "
            "docs/corrections.md)"
        )
    return fn


def _switch_candidates(cls: type, options: dict[str, Any]) -> dict[str, str]:
    """Options that could store less: a storage option on "accelerator" -> "cpu", a dtype option
    at 4 bytes (None: the fp32 master dtype) -> "bf16". Values are the node's, else the class's
    defaults."""
    values = {
        n: p.default
        for n, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    values.update(options)
    out = {}
    for key, value in values.items():
        if value == "accelerator":
            out[key] = "cpu"
        elif key.endswith("dtype") and (
            value is None
            or (isinstance(value, str) and dtype_bytes(value, f"correction.{key}") > 2)
        ):
            out[key] = "bf16"
    return out


def correction_cost(
    node: Any, *, max_staleness: int, partial_rollout: bool, sync_every: int = 1
) -> CorrectionCost:
    """What the correction named by ``node`` (a ``correction`` config node; None: NoCorrection)
    stores and scores, from its class: ``stored_weights(max_staleness=, partial_rollout=,
    **options)`` and ``scoring_passes(max_staleness=, **options)``, ``options`` being the node's
    keys other than ``_component_``. ``switches`` lists the other values of its storage and dtype
    options that would store less, with what the class would store then. With ``sync_every > 1``
    the recipe's anchors inside a sync cycle add the published weights and a swap buffer, both in
    host memory (``minippo.parallel.PublishedWeights``)."""
    component = NO_CORRECTION if node is None else str(_select(node, "_component_"))
    cls = locate(component, "correction._component_")
    options: dict[str, Any] = {}
    if node is not None:
        options = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()}
        options.pop("_component_", None)
    stored_weights = _interface(cls, "stored_weights", component)
    scoring_passes = _interface(cls, "scoring_passes", component)

    cycle = ()
    if sync_every > 1:
        cycle = (
            WeightCopies("published weights (rollout.sync_every)", 1, None, "cpu"),
            WeightCopies("swap buffer of the published weights", 1, None, "cpu"),
        )

    def stored(opts: dict[str, Any]) -> tuple[Any, ...]:
        copies = stored_weights(
            max_staleness=max_staleness, partial_rollout=partial_rollout, **opts
        )
        return (*copies, *cycle)

    now = stored(options)
    switches = []
    for key, value in _switch_candidates(cls, options).items():
        try:
            alt = stored({**options, key: value})
        except (ValueError, TypeError):  # the class does not take this value for this option
            continue
        if alt != now:
            switches.append((f"correction.{key}={value}", alt))
    return CorrectionCost(
        name=cls.__name__,
        stored=now,
        scoring_passes=int(scoring_passes(max_staleness=max_staleness, **options)),
        switches=tuple(switches),
    )


def engine_options(cfg: DictConfig) -> tuple[type | None, dict[str, Any]]:
    """The engine class named by ``engine._component_`` (None without an engine node) and the
    values of the options the plan reads: the node's, else the class's signature defaults
    (absent when the class does not take the option)."""
    node = OmegaConf.select(cfg, "engine", default=None)
    if node is None or "_component_" not in node:
        return None, {}
    cls = locate(str(node._component_), "engine._component_")
    params = inspect.signature(cls).parameters
    out = {}
    names = ("mem_fraction_static", "memory_mode", "weights_cpu_backup", "device", "dtype")
    for name in (*names, "max_batch_size", "in_process"):
        value = node.get(name)
        if value is None and name in params:
            value = params[name].default
        if value is not None and value is not inspect.Parameter.empty:
            out[name] = value
    return cls, out


def _is_torch_engine(cls: type | None) -> bool:
    from minippo.engine.torch_engine import TorchEngine

    return isinstance(cls, type) and issubclass(cls, TorchEngine)


def _rows_in_flight(cfg: DictConfig, ranks: int) -> int:
    """Sequences one rank's engine generates at once: ``groups_per_batch / ranks`` groups (in
    alternate mode ``ceil(... x rollout.oversample)``) of ``samples_per_prompt`` each."""
    groups = int(_select(cfg, "rollout.groups_per_batch")) // ranks
    if rollout_mode(cfg) == "alternate":  # as RolloutQueue.in_flight
        groups = math.ceil(groups * float(setting(cfg, "rollout.oversample")) - 1e-9)
    return max(1, groups * int(_select(cfg, "rollout.samples_per_prompt")))


def plan_inputs_from_config(
    cfg: DictConfig,
    *,
    gpu_mem_gib: float | None = None,
    world_size: int = 1,
    device: str | None = None,
    nnodes: int = 1,
) -> PlanInputs:
    """:class:`PlanInputs` of a run config (see the module docstring and docs/memory.md).

    ``world_size``: the ranks of one node (``minippo run --nproc-per-node``); ``nnodes``: the
    nodes (``--nnodes``), so the run has ``nnodes · world_size`` ranks and ``parallel.sharding``
    splits each parameter over all of them (``fsdp``) or over one node's (``hsdp``);
    ``device``: "cuda" or "cpu"; None: cuda when the engine generates on a GPU (SGLang unless
    ``engine.device: cpu``, :func:`sglang_on_gpu`; TorchEngine on ``cuda``), else cpu. ``gpu_mem_gib``: one GPU's memory (cuda only;
    default 80).
    """
    from minippo.parallel.mesh import shard_ranks, sharding_of

    path = _select(cfg, "checkpoint_path", None)
    if path:
        actor = _args_from_hf_folder(path, "checkpoint_path")
    else:
        actor = _args_from_builder(_select(cfg, "model"), "model")
    critic = None
    if needs_critic(str(_select(cfg, "advantage_estimator"))):
        cpath = _select(cfg, "critic.checkpoint_path", None)
        critic = _args_from_hf_folder(cpath, "critic.checkpoint_path") if cpath else actor
    engine_cls, engine = engine_options(cfg)
    torch_engine_on_gpu = _is_torch_engine(engine_cls) and str(engine["device"]).startswith("cuda")
    if device is None:
        device = "cuda" if sglang_on_gpu(cfg) or torch_engine_on_gpu else "cpu"
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"memory plan: device={device!r} must be cuda or cpu")
    if world_size < 1:
        raise ConfigError(f"memory plan: nproc_per_node={world_size} must be >= 1")
    if nnodes < 1:
        raise ConfigError(f"memory plan: nnodes={nnodes} must be >= 1")
    try:
        sharding = sharding_of(cfg)
    except ValueError as e:
        raise ConfigError(f"memory plan: {e}") from None
    ranks = nnodes * world_size
    split = shard_ranks(sharding, ranks, world_size)
    response = int(_select(cfg, "rollout.max_new_tokens"))
    opt = _select(cfg, "optimizer")
    max_staleness = int(_select(cfg, "rollout.max_staleness"))
    gpu = None
    if device == "cuda":
        gpu = int((gpu_mem_gib if gpu_mem_gib is not None else DEFAULT_GPU_MEM_GIB) * GiB)
    fraction = engine.get("mem_fraction_static") if device == "cuda" else None
    torch_engine = None
    if device == "cuda" and torch_engine_on_gpu:
        torch_engine = TorchEngineShape(  # engine_options: the node's values or the defaults
            rows=min(int(engine["max_batch_size"]), _rows_in_flight(cfg, ranks)),
            prompt_len=_prompt_len(cfg),
            max_new_tokens=response,
            dtype_bytes=dtype_bytes(str(engine["dtype"]), "engine.dtype"),
            own_process=not engine["in_process"],
        )
    seq_len = _prompt_len(cfg) + response
    micro_batch = _micro_batch_rows(cfg, ranks, seq_len)
    score_rows = _score_rows(cfg, ranks, seq_len)
    step = None  # what one training step runs, for the bytes it sends across nodes
    if nnodes > 1:
        step = _step_shape(cfg, ranks, micro_batch, score_rows)
    micro_tokens = setting(cfg, "ppo.max_tokens_per_micro_batch")
    score_tokens = setting(cfg, "ppo.score_max_tokens_per_micro_batch")
    return PlanInputs(
        actor=actor,
        critic=critic,
        reference=float(_select(cfg, "kl.coef")) > 0,
        world_size=split,
        nnodes=nnodes,
        ranks_per_node=world_size,
        sharding=sharding,
        step=step,
        device=device,
        master_bytes=dtype_bytes(MASTER_DTYPE),
        compute_bytes=dtype_bytes(_select(cfg, "dtype"), "dtype"),
        micro_batch=micro_batch,
        seq_len=seq_len,
        response_len=response,
        packed=bool(setting(cfg, "ppo.pack")),
        micro_tokens=None if micro_tokens is None else int(micro_tokens),
        score_tokens=None if score_tokens is None else int(score_tokens),
        activation_checkpointing=bool(_select(cfg, "activation_checkpointing")),
        logits_chunk=DEFAULT_CHUNK_SIZE,  # the recipe scores with the default chunk
        actor_optimizer=optimizer_spec(opt),
        critic_optimizer=optimizer_spec(_select(cfg, "critic.optimizer") if critic else opt),
        correction=correction_cost(
            OmegaConf.select(cfg, "correction", default=None),
            max_staleness=max_staleness,
            partial_rollout=bool(_select(cfg, "rollout.partial_rollout")),
            sync_every=int(setting(cfg, "rollout.sync_every")),
        ),
        score_rows=score_rows,
        engine_mem_fraction=None if fraction is None else float(fraction),
        torch_engine=torch_engine,
        rollout_mode=rollout_mode(cfg),
        offload_trainer=bool(setting(cfg, "rollout.offload_trainer")),
        engine_weights_host_copy=bool(engine.get("weights_cpu_backup", False)),
        gpu_mem_bytes=gpu,
        update_snapshot=setting(cfg, "ppo.max_update_kl") is not None,
    )


def plan_from_config(
    cfg: DictConfig,
    *,
    gpu_mem_gib: float | None = None,
    world_size: int = 1,
    device: str | None = None,
    nnodes: int = 1,
) -> MemoryPlan:
    """The memory plan of a run config (see :func:`plan_inputs_from_config`); with ``nnodes > 1``
    also the bytes a step sends across nodes under FSDP and HSDP (:mod:`minippo.plan.network`)."""
    return plan_memory(
        plan_inputs_from_config(
            cfg, gpu_mem_gib=gpu_mem_gib, world_size=world_size, device=device, nnodes=nnodes
        )
    )


def _step_shape(cfg: DictConfig, ranks: int, micro_batch: int, score_rows: int) -> Any:
    """:class:`~minippo.plan.network.StepShape` of one training step on each of ``ranks`` (with
    token budgets: every sequence of the longest length, the most forwards)."""
    from minippo.plan.network import StepShape

    groups = int(_select(cfg, "rollout.groups_per_batch"))
    return StepShape(
        rows_per_rank=max(1, groups * int(_select(cfg, "rollout.samples_per_prompt")) // ranks),
        micro_batch=micro_batch,
        minibatches=int(_select(cfg, "ppo.minibatches")),
        epochs=int(_select(cfg, "ppo.epochs")),
        score_rows=score_rows,
        sync_every=int(setting(cfg, "rollout.sync_every")),
        engine_bytes=_engine_bytes(cfg),
    )


def _engine_bytes(cfg: DictConfig) -> int:
    """Bytes per element of the weights published to the engine: ``engine.dtype``, else the
    engine class's default dtype, else fp32."""
    node = OmegaConf.select(cfg, "engine", default=None)
    value = None if node is None else node.get("dtype")
    if value is None and node is not None and "_component_" in node:
        cls = locate(str(node._component_), "engine._component_")
        default = inspect.signature(cls).parameters.get("dtype")
        if default is not None and isinstance(default.default, str):
            value = default.default
    return dtype_bytes(value or "fp32", "engine.dtype")
