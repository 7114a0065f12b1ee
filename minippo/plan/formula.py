"""The memory plan's formulas: per-rank bytes of every item of a run, from shapes alone.

Everything is counted per rank (one GPU, or one process on CPU). Sharded state follows FSDP2's
dim-0 split; rank 0 holds the largest shard, so the plan is rank 0's. For a parameter of shape
``(d0, ...)`` on W ranks the local shard has ``ceil(d0 / W) · prod(...)`` elements.

What the plan counts (P = local parameter elements; m = master bytes per element, c = compute
bytes; T tokens per training forward: ``ppo.max_tokens_per_micro_batch`` (packed passes compute
on real tokens only), else micro_batch · seq_len (every row as long as the longest allowed; the
padded positions when ``ppo.pack: false``); R = T · response_len / seq_len scored tokens):

    parameters            P · m                                  (FSDP2 sharded master weights)
    gradients             P · m                                  (sharded, same dtype as params)
    optimizer states      see minippo.training.optimizers.optimizer_state_bytes
    FSDP working set      (sharded) all-gathered root group (embeddings, final norm, lm_head) for
                          the whole step + 2 blocks (current + prefetched), in c; + the root
                          group's unsharded gradients in c and in the fp32 reduce dtype
    activations           saved for backward: Σ_blocks block_bytes(T) + globals (see
                          ``block_saved_bytes_per_token``); with activation checkpointing only each
                          block's input c·T·D is kept and one block is recomputed at a time;
                          plus, for the actor, the fused loss's full-vocabulary buffers
                          (fused_loss_bytes; the critic: its value head)
    reference model       P · m (frozen, sharded like the actor, no gradients or optimizer)
    critic                the same four items for the value model
    correction            what the correction class declares (``stored_weights``): per entry
                          copies · P · its dtype's bytes (None: m), on the device ("accelerator")
                          or in host memory ("cpu")
    no-grad passes        reference logprobs / critic values / correction anchors before the updates:
                          one forward's working set (``scoring_bytes``) over score_rows sequences
    engine                engine.mem_fraction_static · GPU memory (SGLang's static pool: weights + KV);
                          TorchEngine on the GPU (``engine.device: cuda``): its weights in its dtype
                          + the KV cache of one wave + the larger of the prefill's and one decode
                          step's working set (``torch_engine_bytes``)
    CUDA context          1 GiB (GPU only): an estimate of the CUDA context (0.5 GiB) plus the
                          allocator slack the trainer may keep reserved beyond its live tensors
                          after empty_cache (0.5 GiB, checked by minippo.plan.reserved_vs_live);
                          NCCL runs without NVLS buffers (NCCL_NVLS_ENABLE=0, set by
                          minippo.parallel.init_distributed as SGLang sets it); the rest of NCCL's
                          buffers is not counted apart
    pinned host memory    (GPU runs) offloaded states, host snapshots and CPUOffload states, each
                          tensor's block rounded up to a power of two (pinned_rounding)

Actor and critic run their backward passes one after the other, so only the larger of their
activation sets is counted at the peak. Gradients and training activations (the "train" phase)
and the no-grad passes (the "score" phase) are never alive together: the trainer's peak is the
larger phase on top of everything else.

``rollout.mode`` decides when the engine's share is alive:

    overlap      the engine generates while the trainer trains: engine + trainer peak at once
    alternate    two phases that take turns on the GPU:
                 generation = engine + what the trainer keeps on the device between steps
                   (parameters, optimizer states, reference, the correction's device copies, CUDA
                   context; the actor's and critic's parameters and optimizer states go to pinned
                   host memory with rollout.offload_trainer); gradients are freed at every
                   optimizer step, activations and FSDP's unsharded parameters after each pass
                 training = trainer peak + what the engine keeps after releasing its memory
                   (ENGINE_AFTER_RELEASE_BYTES: its scheduler's CUDA context, 0.5 GiB, an
                   estimate)
                 the verdict is on the larger phase
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minippo.config import dtype_bytes
from minippo.training.optimizers import (
    OptimizerSpec,
    StateBytes,
    local_numel,
    optimizer_state_bytes,
)

__all__ = [
    "ActivationBytes",
    "CorrectionCost",
    "GiB",
    "MemoryPlan",
    "PlanInputs",
    "PlanItem",
    "TorchEngineShape",
    "activation_bytes",
    "block_saved_bytes_per_token",
    "fused_loss_bytes",
    "model_param_shapes",
    "pinned_rounding",
    "plan_memory",
    "scoring_bytes",
    "torch_engine_bytes",
]

GiB = 1 << 30
# One process's CUDA context (driver state, cuBLAS/cuDNN handles and workspaces, loaded kernels):
# an estimate, typical of H100s with recent drivers, until a GPU run measures it.
CUDA_CONTEXT_ESTIMATE_BYTES = GiB // 2
# What the trainer's caching allocator may keep reserved beyond its live tensors once
# torch.cuda.empty_cache() has run (blocks of partly used segments): the margin that
# minippo.plan.reserved_vs_live checks at each wake of the engine (docs/memory.md).
ALLOCATOR_SLACK_BYTES = GiB // 2
CUDA_CONTEXT_BYTES = CUDA_CONTEXT_ESTIMATE_BYTES + ALLOCATOR_SLACK_BYTES
# What SGLang keeps on the GPU after release_memory_occupation (weights, KV cache and CUDA graphs
# released): its scheduler process keeps its own CUDA context. An estimate (one context), not
# measured; the reading of SGLang's source (docs/sglang_backend.md) gives no figure.
ENGINE_AFTER_RELEASE_BYTES = CUDA_CONTEXT_ESTIMATE_BYTES
ROLLOUT_MODES = ("alternate", "overlap")


# ----------------------------------------------------------------------------------------------
# Shapes


def forward_tokens(budget: int, seq_len: int) -> int:
    """The most real tokens one forward of a token budget holds: the budget, or one sequence of
    the longest length ``seq_len`` when that is longer (the recipe gives it a forward alone)."""
    return max(int(budget), seq_len)


def model_param_shapes(args: Any, *, value_head: bool = False) -> list[tuple[int, ...]]:
    """Shapes of the distinct parameters of ``Transformer(args)`` (``ValueModel`` with
    ``value_head``), built on the meta device: nothing is allocated. Tied weights count once."""
    from minippo.models import Transformer, ValueModel

    with torch.device("meta"):
        model = ValueModel(args) if value_head else Transformer(args)
    return [tuple(p.shape) for p in model.parameters()]


def _block_shapes(args: Any) -> list[tuple[int, ...]]:
    from minippo.models.model import TransformerBlock

    with torch.device("meta"):
        block = TransformerBlock(args)
    return [tuple(p.shape) for p in block.parameters()]


def _numel(shapes: Iterable[Sequence[int]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _local(shapes: Iterable[Sequence[int]], world: int) -> list[int]:
    return [local_numel(s, world, 0) for s in shapes]


# ----------------------------------------------------------------------------------------------
# Activations


def block_saved_bytes_per_token(
    args: Any, *, compute_bytes: int, mask: bool, device: str = "cuda", packed: bool = False
) -> int:
    """Bytes one decoder block saves for backward per token (no checkpointing).

    Counted from the ops of ``minippo.models.model.TransformerBlock`` (c = compute bytes, norms
    compute in fp32; each RMSNorm is one autograd node that saves its fp32 normed input and
    rsqrt; RoPE's multiplications save only cos/sin):
        2 RMSNorms      2 · (4D normed + 4 rsqrt + c·D output, saved by the next linear layers)
        q/k RMSNorm     (H + H_kv) · (4·hd + 4)                                 (Qwen3 only)
        attention       c·hd·(2H + 2H_kv') (q, k after RoPE, v, output) + 4H (logsumexp);
                        with a padding mask on a GPU H_kv' = H (the model repeats k/v for the
                        masked fused kernels, which lack GQA; the CPU kernel takes GQA with a
                        mask); otherwise H_kv' = H_kv. The additive mask itself is made once per
                        forward and shared by the blocks: :func:`activation_bytes` counts it.
                        Packed (``packed``, no mask): H_kv' = H_kv (varlen and SDPA take GQA); on
                        CPU + c·H·hd, the output gathered back from the attention buckets (the
                        buckets' right padding, at most 1.41x their tokens, is not counted)
        SwiGLU          4·c·I (gate, up, silu(gate), their product)
    ``device``: "cuda" or "cpu" (where the block runs).
    """
    if packed and mask:
        raise ValueError("a packed pass has no padding mask: pass mask=False with packed=True")
    c, D, inter, hd = compute_bytes, args.dim, args.intermediate_size, args.head_dim
    H, Hkv = args.n_heads, args.n_kv_heads
    total = 2 * (4 * D + 4 + c * D)
    if args.qk_norm:
        total += (H + Hkv) * (4 * hd + 4)
    # with a padding mask the masked fused GPU kernels take no GQA: k/v are repeated to H heads
    kv_heads = H if mask and device != "cpu" else Hkv
    total += c * hd * (2 * H + 2 * kv_heads) + 4 * H
    if packed and device == "cpu":
        total += c * H * hd
    total += 4 * c * inter
    return total


@dataclass
class ActivationBytes:
    """Activation memory of one training forward+backward of one model on one micro-batch.

    Fields:
        saved:     bytes held for backward at the end of the forward
        transient: the largest extra working memory in backward (a recomputed lm_head chunk, or a
                   recomputed block under activation checkpointing, and the gradient of the
                   hidden states)
    """

    saved: int
    transient: int

    @property
    def total(self) -> int:
        return self.saved + self.transient


def activation_bytes(
    args: Any,
    *,
    micro_batch: int,
    seq_len: int,
    response_len: int,
    compute_bytes: int,
    checkpointing: bool,
    logits_chunk: int,
    lm_head: bool = True,
    mask: bool = True,
    entropy: bool = True,
    device: str = "cuda",
    tokens: int | None = None,
    packed: bool = False,
    fused: bool = False,
) -> ActivationBytes:
    """Activations of ``micro_batch`` sequences of ``seq_len`` tokens, ``response_len`` of which
    are scored (actor: chunked logprobs over the vocabulary; critic: ``lm_head=False``, a scalar
    head); or, with ``tokens``, of a packed micro-batch of that many real tokens (sequences as
    long as ``seq_len``, so ``tokens · response_len / seq_len`` scored). ``packed``: the packed
    attention of :func:`block_saved_bytes_per_token` (then ``mask`` must be False).

        T = micro_batch · seq_len (or tokens), R = T · response_len / seq_len, c = compute bytes
        per block              block_saved_bytes_per_token · T   (checkpointed: c·T·D, the input)
        globals                8·T (token ids) + 2·c·T·hd (RoPE cos/sin) + final norm
                               (4·T·D + 4·T) + the scored hidden rows c·R·D (actor); with a
                               padding mask + c·T·seq_len (the additive mask [B, 1, S, S], made
                               once per forward and saved by every block's attention)
        lm_head chunk (bwd)    n · V · 16 bytes (20 with the entropy, which the recipe's training
                               forward computes), n = min(logits_chunk, R): the chunk's logits, their
                               fp32 copy, scaled copy, softmax and gradients (measured on CPU)
        hidden gradient (bwd)  4·T·D
        recomputed block (AC)  one block's saved bytes, during its backward

    ``fused``: the actor's update through ``minippo.models.fused_policy_loss`` (the recipe's only
    path), whose pass at the end of the forward holds instead of the recomputed chunk
    (:func:`fused_loss_bytes`) its full-vocabulary buffers and the hidden-state gradient c·R·D,
    which stays until backward: transient = c·R·D + max(fused_loss_bytes, 4·T·D + the AC block).
    """
    for name, v in [("micro_batch", micro_batch), ("seq_len", seq_len)]:
        if v < 1:
            raise ValueError(f"{name} ({v}) must be >= 1")
    if not 0 <= response_len <= seq_len:
        raise ValueError(f"response_len ({response_len}) must be in [0, seq_len ({seq_len})]")
    c, D = compute_bytes, args.dim
    T = micro_batch * seq_len if tokens is None else tokens
    R = T * response_len // seq_len
    block = block_saved_bytes_per_token(
        args, compute_bytes=c, mask=mask, device=device, packed=packed
    )
    block *= T
    blocks = args.n_layers * (c * T * D if checkpointing else block)
    globals_ = 8 * T + 2 * c * T * args.head_dim + (4 * T * D + 4 * T)
    if mask:
        globals_ += c * T * seq_len
    transient = 4 * T * D
    if checkpointing:
        transient += block
    if lm_head:
        globals_ += c * R * D
        n = min(logits_chunk, max(R, 1))
        if fused:
            fused_pass = fused_loss_bytes(n, args.vocab_size, D, c)
            return ActivationBytes(
                saved=blocks + globals_, transient=c * R * D + max(fused_pass, transient)
            )
        transient += n * args.vocab_size * (20 if entropy else 16)
    else:
        globals_ += c * T * D  # the value head's input
    return ActivationBytes(saved=blocks + globals_, transient=transient)


def fused_loss_bytes(n: int, vocab: int, dim: int, compute_bytes: int) -> int:
    """Peak bytes of ``fused_policy_loss``'s forward beyond its inputs and the lm_head gradient
    it hands to backward (counted as a gradient: the FSDP working set's root gradient, or the
    gradients item), for chunks of ``n`` tokens, V = ``vocab``, D = ``dim``, c = compute bytes
    (the lm_head weight's and the hidden states' dtype):

        c = 4 (fp32)   8·n·V                   z and p, fp32 [n, V]; ∂z is p in place, and the
                                               fp32 gradient accumulator is the gradient itself
        c < 4 (bf16)   4·V·D                   fp32 accumulator of the lm_head gradient
                       + max(8·n·V,            z and p
                             c·n·V + (c+4)·V·D) ∂z in c, and a chunk's (∂z)ᵀh in c and its fp32
                                               copy, added to the accumulator

    (the lm_head gradient in c is made from the accumulator at the end: c·V·D, the gradient
    itself). For Qwen3-4B in bf16 (V = 151936, D = 2560, n = 1024): 3.91 GiB.
    """
    c = compute_bytes
    if c >= 4:
        return 8 * n * vocab
    return 4 * vocab * dim + max(8 * n * vocab, c * n * vocab + (c + 4) * vocab * dim)


# ----------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class CorrectionCost:
    """What the plan needs to know about the correction, as its class declares it (read by
    :func:`minippo.plan.correction_cost` from ``stored_weights`` and ``scoring_passes``).

    Fields:
        name:           the class name, for the table
        stored:         the class's ``WeightCopies`` (``what``, ``copies`` of the actor's local
                        shards, ``dtype`` name or None for the master dtype, ``storage`` "cpu" |
                        "accelerator")
        scoring_passes: extra no-grad actor forwards per step (0: no actor scoring pass)
        switches:       ``(override, stored)`` pairs: another value of one of the class's options
                        (``correction.swap_storage=cpu``) and the weights it would store then
    """

    name: str
    stored: tuple[Any, ...] = ()
    scoring_passes: int = 0
    switches: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    def bytes(
        self, P: int, master_bytes: int, stored: tuple[Any, ...] | None = None
    ) -> tuple[int, int]:
        """(device, host) bytes of ``stored`` (default: this correction's) for ``P`` local
        parameter elements of the actor."""
        device = host = 0
        for c in self.stored if stored is None else stored:
            n = c.copies * P * (master_bytes if c.dtype is None else dtype_bytes(c.dtype))
            if c.storage == "cpu":
                host += n
            else:
                device += n
        return device, host


@dataclass(frozen=True)
class TorchEngineShape:
    """What a TorchEngine on the GPU holds depends on (read from the config by
    :func:`~minippo.plan.plan_from_config`).

    Fields:
        rows:           sequences decoded together in one wave: ``engine.max_batch_size``, or
                        fewer when a rank has fewer rows in flight
        prompt_len:     the longest prompt (a wave's prompts are left-padded to it)
        max_new_tokens: ``rollout.max_new_tokens``
        dtype_bytes:    bytes per element of ``engine.dtype`` (weights, activations, KV cache)
        own_process:    the engine runs in its own process (``engine.in_process: false``), which
                        keeps its own CUDA context, asleep too (not counted)
    """

    rows: int
    prompt_len: int
    max_new_tokens: int
    dtype_bytes: int
    own_process: bool = True


def torch_engine_bytes(args: Any, shape: TorchEngineShape) -> dict[str, int]:
    """Device bytes of TorchEngine while it generates (``minippo.engine.torch_engine``), by part:

        weights   every distinct parameter (a tied lm_head once) · e          (e = dtype bytes)
        kv_cache  rows · L · 2 · H_kv · hd · (prompt_len + max_new_tokens) · e  (preallocated for
                  the whole wave)
        working   the larger of
                  prefill: one no-grad forward over rows · prompt_len tokens without the lm_head
                  (:func:`scoring_bytes`), and the last position's logits rows · V · e;
                  decode step: the logits rows · V · e, their fp32 copy and the sampler's fp32
                  exponentials, rows · V · (e + 8)
    Not counted: the copy of the cache that dropping finished rows makes (``KVCache.keep``:
    up to the rows still running, while the old cache is alive), and the process's CUDA context.
    """
    e, rows, V = shape.dtype_bytes, shape.rows, args.vocab_size
    weights = _numel(model_param_shapes(args)) * e
    seq = shape.prompt_len + shape.max_new_tokens
    kv = rows * args.n_layers * 2 * args.n_kv_heads * args.head_dim * seq * e
    prefill = scoring_bytes(
        args,
        rows=rows,
        seq_len=max(shape.prompt_len, 1),
        response_len=1,
        compute_bytes=e,
        logits_chunk=rows,
        lm_head=False,
    )
    prefill += rows * V * e
    decode = rows * V * (e + 8)
    return {"weights": weights, "kv_cache": kv, "working": max(prefill, decode)}


@dataclass
class PlanInputs:
    """Everything the plan depends on (read from a run config by :func:`plan_from_config`).

    Fields:
        actor / critic:          ModelArgs (critic None for critic-free estimators)
        reference:               a frozen reference model is kept (KL to the reference)
        world_size:              ranks sharing the FSDP2 shards (GPUs of the node)
        device:                  "cuda" or "cpu"
        master_bytes:            bytes per element of the stored (sharded) parameters
        compute_bytes:           bytes per element of activations / all-gathered parameters
        micro_batch, seq_len, response_len: one training forward (sequences, tokens, scored)
        packed:                  the passes compute on real tokens only (``ppo.pack``): no mask
        micro_tokens:            real tokens per training forward (ppo.max_tokens_per_micro_batch;
                                 None: micro_batch · seq_len)
        score_tokens:            real tokens per no-grad forward
                                 (ppo.score_max_tokens_per_micro_batch; None: score_rows · seq_len)
        activation_checkpointing, logits_chunk
        actor_optimizer / critic_optimizer: (OptimizerSpec, minimal_size)
        correction:              :class:`CorrectionCost` of the correction class
        score_rows:              sequences per forward of the no-grad passes (None: micro_batch)
        engine_mem_fraction:     fraction of GPU memory the engine takes (GPU only)
        torch_engine:            :class:`TorchEngineShape` of a TorchEngine on the GPU (None:
                                 no such engine)
        rollout_mode:            "overlap" (the engine generates while the trainer trains) or
                                 "alternate" (they take turns; the engine releases its memory
                                 while the trainer trains): see the module docstring
        offload_trainer:         alternate mode: the actor's and critic's parameters and optimizer
                                 states wait in pinned host memory while the engine generates
        engine_weights_host_copy: sleep mode with weights_cpu_backup: a bf16 host copy of the
                                 full weights
        gpu_mem_bytes:           memory of one GPU (None on CPU)
        nnodes, ranks_per_node:  the run's nodes and ranks per node (ranks_per_node None:
                                 world_size); ``world_size`` is then the ranks one parameter is
                                 split over: ranks_per_node under HSDP, nnodes · ranks_per_node
                                 under FSDP
        sharding:                "fsdp" or "hsdp" (parallel.sharding)
        step:                    :class:`~minippo.plan.network.StepShape` of one training step,
                                 for the bytes it sends across nodes (None: not counted)
        update_snapshot:         ppo.max_update_kl is set: each actor step first copies the
                                 actor's parameters and optimizer states, and a step to shorten
                                 its stepped parameters (freed after the step)
    """

    actor: Any
    critic: Any | None
    reference: bool
    world_size: int
    device: str
    master_bytes: int
    compute_bytes: int
    micro_batch: int
    seq_len: int
    response_len: int
    activation_checkpointing: bool
    logits_chunk: int
    actor_optimizer: tuple[OptimizerSpec, int]
    critic_optimizer: tuple[OptimizerSpec, int]
    correction: CorrectionCost
    score_rows: int | None = None
    engine_mem_fraction: float | None = None
    torch_engine: TorchEngineShape | None = None
    rollout_mode: str = "overlap"
    offload_trainer: bool = False
    engine_weights_host_copy: bool = False
    gpu_mem_bytes: int | None = None
    packed: bool = False
    micro_tokens: int | None = None
    score_tokens: int | None = None
    nnodes: int = 1
    ranks_per_node: int | None = None
    sharding: str = "fsdp"
    step: Any = None
    update_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.ranks_per_node is None:
            self.ranks_per_node = self.world_size

    @property
    def ranks(self) -> int:
        """Ranks of the run: nnodes · ranks_per_node."""
        return self.nnodes * (self.ranks_per_node or self.world_size)

    @property
    def mask(self) -> bool:
        """The passes build a ``[B, 1, S, S]`` padding mask: the padded passes (``ppo.pack:
        false``)."""
        return not self.packed

    @property
    def train_tokens(self) -> int:
        """T, the tokens of one training forward: the budget (a sequence longer than it goes
        alone), else micro_batch · seq_len."""
        if self.micro_tokens is None:
            return self.micro_batch * self.seq_len
        return forward_tokens(self.micro_tokens, self.seq_len)

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the models: more than one rank, or mixed precision (the recipe refuses a
        compute dtype other than fp32 without a process group)."""
        return self.world_size > 1 or self.compute_bytes != self.master_bytes


@dataclass
class PlanItem:
    """One line of the plan: bytes on the device (GPU; RAM on CPU runs) and in host memory."""

    name: str
    device: int = 0
    host: int = 0
    note: str = ""
    at_peak: bool = True  # False: listed, but not alive at the same time as the larger twin
    phase: str = "all"  # "train": only during PPO updates; "score": only in the no-grad passes
    # while the engine generates (rollout.mode=alternate): "kept" on the device, "offload" kept
    # unless rollout.offload_trainer moves it to pinned host memory, "freed" not alive
    while_generating: str = "kept"
    # of ``host``, the bytes the CUDA host allocator adds by rounding pinned blocks up to powers
    # of two (held by the process, not by tensors: a tensor tracker does not see them)
    pinned_extra: int = 0


@dataclass
class MemoryPlan:
    """The items of a plan and their totals; ``actor_numel``: the actor's local parameter elements
    (P), which the correction's stored weights are counted in. ``measured``: the
    :class:`~minippo.plan.measured.MeasuredPeak` of one recipe step, when it was run; the totals
    and the verdict then come from it (the items stay the formula's)."""

    inputs: PlanInputs
    items: list[PlanItem] = field(default_factory=list)
    actor_numel: int = 0
    measured: Any = None
    # several nodes: the bytes a step sends across nodes per sharding, and the formula's device
    # total per rank under each sharding ({"fsdp": ..., "hsdp": ...})
    traffic: dict[str, Any] = field(default_factory=dict)
    layout_totals: dict[str, int] = field(default_factory=dict)
    # pinned host buffers (CUDA runs) per byte asked: each rounded up to a power of two by the
    # CUDA host allocator (pinned_rounding); 1.0 on CPU runs
    pinned_factor: float = 1.0

    def _phase_device(self, phase: str, engine: bool) -> int:
        return sum(
            i.device
            for i in self.items
            if i.at_peak and i.phase == phase and (engine or not i.name.startswith("engine"))
        )

    def _device(self, engine: bool) -> int:
        # gradients and training activations are freed before the no-grad passes of the next
        # step and vice versa: the peak is the larger of the two phases
        train, score = self._phase_device("train", engine), self._phase_device("score", engine)
        return self._phase_device("all", engine) + max(train, score)

    @property
    def peak_phase(self) -> str:
        """ "train" (PPO updates) or "score" (the no-grad passes), whichever peaks."""
        train, score = self._phase_device("train", True), self._phase_device("score", True)
        return "train" if train >= score else "score"

    def _tensor_host(self) -> int:
        """Host bytes of the trainer's tensors at the peak (the items less the engine's, without
        the pinned allocator's rounding): what a tensor tracker counts in host memory."""
        extra = sum(i.pinned_extra for i in self.items if i.at_peak)
        return self._sum("host", "engine", without=True) - extra

    def _sum(self, field_: str, prefix: str, *, without: bool = False) -> int:
        return sum(
            getattr(i, field_)
            for i in self.items
            if i.at_peak and i.name.startswith(prefix) != without
        )

    @property
    def formula_trainer_total(self) -> int:
        """The formula's trainer bytes at the peak in the memory the device uses: GPU memory on
        CUDA runs; on CPU runs RAM, where host items live too."""
        return self._device(False) + (self.host_total if self.inputs.device == "cpu" else 0)

    @property
    def trainer_total(self) -> int:
        """Trainer bytes at the peak in the memory the device uses (see
        :attr:`formula_trainer_total`); from the measured step when there is one: on CPU its
        peak, on CUDA its peak less the trainer's host items, plus the assumed CUDA context."""
        if self.measured is None:
            return self.formula_trainer_total
        if self.inputs.device == "cpu":
            return self.measured.peak
        host = self._tensor_host()
        return self.measured.peak - host + self._sum("device", "CUDA")

    @property
    def tensor_total(self) -> int:
        """The formula's live tensor bytes of the trainer at the peak, device and host memory
        together (what a tensor tracker and the measured step count): the trainer total without
        the assumed CUDA context, plus the host items other than the engine's."""
        host = self._tensor_host()
        return self._device(False) - self._sum("device", "CUDA") + host

    @property
    def alternates(self) -> bool:
        """rollout.mode=alternate with an engine on the GPU: generation and training take turns."""
        engine = any(i.name.startswith("engine") for i in self.items)
        return engine and self.inputs.rollout_mode == "alternate"

    @property
    def engine_after_release(self) -> int:
        """What a released engine keeps on the GPU while the trainer trains (alternate mode): its
        own process's CUDA context (ENGINE_AFTER_RELEASE_BYTES, an estimate); 0 in overlap mode
        and for a TorchEngine in the trainer's process."""
        t = self.inputs.torch_engine
        own = t is None or t.own_process
        return ENGINE_AFTER_RELEASE_BYTES if self.alternates and own else 0

    @property
    def training_total(self) -> int:
        """Bytes on the device while the trainer trains, at its peak: the trainer, plus the
        engine's share in overlap mode (in alternate mode the engine has released it:
        :attr:`engine_after_release`); RAM column on CPU runs."""
        after_release = self.engine_after_release
        if self.measured is None:
            return self._device(True) + after_release
        host = self._tensor_host()
        engine = self._sum("device", "engine")
        return self.measured.peak - host + self._sum("device", "CUDA") + engine + after_release

    def generation_total(self, offload: bool | None = None) -> int:
        """Bytes on the device while the engine generates in alternate mode: its share and what
        the trainer keeps there between steps (items ``while_generating`` "kept", and "offload"
        unless ``offload``; None: ``rollout.offload_trainer`` as configured). From the formulas
        (the measured step does not generate)."""
        offload = self.inputs.offload_trainer if offload is None else offload
        return sum(
            i.device
            for i in self.items
            if i.while_generating == "kept" or (i.while_generating == "offload" and not offload)
        )

    @property
    def offloaded(self) -> int:
        """Bytes rollout.offload_trainer moves to pinned host memory while the engine generates
        (the actor's and critic's parameters and optimizer states on the device)."""
        return sum(i.device for i in self.items if i.while_generating == "offload")

    @property
    def device_total(self) -> int:
        """Bytes on the device at the peak, the engine's included (RAM column on CPU runs): in
        alternate mode the larger of the generation and the training phase."""
        if self.alternates:
            return max(self.training_total, self.generation_total())
        return self.training_total

    @property
    def host_total(self) -> int:
        """Host bytes of the items, plus the pinned buffers of rollout.offload_trainer."""
        offload = self.alternates and self.inputs.offload_trainer
        pinned = int(self.offloaded * self.pinned_factor)
        return sum(i.host for i in self.items) + (pinned if offload else 0)

    @property
    def fits(self) -> bool | None:
        g = self.inputs.gpu_mem_bytes
        return None if g is None else self.device_total <= g

    def biggest(self, n: int = 3) -> list[PlanItem]:
        items = [
            i
            for i in self.items
            if i.at_peak
            and i.phase in ("all", self.peak_phase)
            and not i.name.startswith(("engine", "CUDA"))
        ]
        return sorted(items, key=lambda i: -i.device)[:n]

    def advice(self) -> list[str]:
        """Switches that shrink the biggest items, with the bytes each would save on the device."""
        x, out = self.inputs, []
        for item in self.biggest(4):
            name = item.name
            if name.endswith("optimizer states"):
                critic = name.startswith("critic")
                spec = (x.critic_optimizer if critic else x.actor_optimizer)[0]
                key = "critic.optimizer._component_" if critic else "optimizer._component_"
                if not spec.bits:
                    out.append(
                        f"{name}: {key}=torchao.optim.AdamW8bit (~2 bytes/param instead of "
                        f"{2 * x.master_bytes}) or torchao.optim.AdamW4bit (~1 byte/param)"
                    )
            elif name.endswith("activations"):
                if not x.activation_checkpointing:
                    out.append(f"{name}: activation_checkpointing=true (keeps one input per block)")
                if x.micro_tokens is not None:
                    out.append(
                        f"{name}: a smaller ppo.max_tokens_per_micro_batch (now {x.micro_tokens})"
                    )
                elif x.micro_batch > 1:
                    out.append(f"{name}: a smaller micro-batch (now {x.micro_batch} sequences)")
                if x.mask:
                    out.append(
                        f"{name}: the padding mask costs c·S² per sequence and block; "
                        "ppo.pack=true computes on the real tokens only, with no mask"
                    )
            elif name.startswith("no-grad"):
                out.append(
                    f"{name}: a smaller ppo.score_max_tokens_per_micro_batch (now {x.score_tokens})"
                    if x.score_tokens is not None
                    else f"{name}: a smaller ppo.score_micro_batch_size (now "
                    f"{x.score_rows or x.micro_batch} sequences per forward)"
                )
            elif name.startswith("correction") and item.device:
                for override, stored in x.correction.switches:
                    dev, host = x.correction.bytes(self.actor_numel, x.master_bytes, stored)
                    if dev < item.device:
                        more = f", {_size(host - item.host)} more in host memory" * (
                            host > item.host
                        )
                        out.append(
                            f"{name}: {override} ({_size(item.device - dev)} less on the device{more})"
                        )
            elif name.endswith(("gradients", "parameters")) and x.master_bytes > 2:
                out.append(f"{name}: more ranks shard it further (now {x.world_size})")
        now_dev, now_host = x.correction.bytes(self.actor_numel, x.master_bytes)
        for override, stored in x.correction.switches:
            dev, host = x.correction.bytes(self.actor_numel, x.master_bytes, stored)
            if dev == now_dev and host < now_host:
                out.append(
                    f"host: {override} stores {_size(now_host - host)} less of the "
                    f"{x.correction.name} correction's weights in host memory"
                )
        if self.traffic and x.sharding == "fsdp":
            saved = self.traffic["fsdp"].total - self.traffic["hsdp"].total
            more = ""
            if self.layout_totals:
                extra = self.layout_totals["hsdp"] - self.layout_totals["fsdp"]
                more = f", at {_size(extra)} more per rank (parameters split within a node only)"
            out.append(
                f"network: parallel.sharding=hsdp sends {_size(saved)} less across nodes per "
                f"step{more}"
            )
        engine = int((x.engine_mem_fraction or 0) * (x.gpu_mem_bytes or 0))
        if engine and not self.alternates:
            out.append(
                f"engine: engine.mem_fraction_static={x.engine_mem_fraction} reserves "
                f"{_size(engine)}; a smaller fraction leaves more for training (less KV cache), "
                "or rollout.mode=alternate (engine.memory_mode=sleep) releases it while the "
                "trainer trains (generation and training take turns)"
            )
        if self.alternates and self.generation_total() > self.training_total:
            if not x.offload_trainer:
                out.append(
                    f"generation: rollout.offload_trainer=true moves {_size(self.offloaded)} "
                    "(actor/critic parameters and optimizer states) to pinned host memory while "
                    "the engine generates"
                )
            out.append(
                f"generation: a smaller engine.mem_fraction_static (now {x.engine_mem_fraction}, "
                f"{_size(engine)}: weights + KV cache)"
            )
        return out

    def table(self) -> str:
        """The per-rank table, the verdict, the biggest items and the switches."""
        x = self.inputs
        where = "GPU" if x.device == "cuda" else "RAM"
        # GiB for real runs; MiB when everything is small (the tiny CPU job)
        unit, div = (
            ("GiB", GiB) if max(self.device_total, self.host_total) >= GiB else ("MiB", 2**20)
        )

        def fmt(n: int) -> str:
            return f"{n / div:.2f}"

        ranks = f"{x.world_size} rank(s)"
        if x.nnodes > 1:
            ranks = (
                f"{x.ranks} ranks = {x.nnodes} nodes x {x.ranks_per_node}, {x.sharding}: "
                f"parameters split over {x.world_size}"
            )
        lines = [
            f"Per-rank memory plan ({ranks}, {x.device}; {self._forward_text()}; activation "
            f"checkpointing {'on' if x.activation_checkpointing else 'off'})",
            "",
            f"{'item':<30}{where + ' ' + unit:>10}{'host ' + unit:>10}  note",
        ]
        for i in self.items:
            dev = fmt(i.device) + ("" if i.at_peak and i.phase in ("all", self.peak_phase) else "*")
            lines.append(f"{i.name:<30}{dev:>10}{fmt(i.host):>10}  {i.note}")
        lines.append("-" * 60)
        m = self.measured
        lines.append(
            f"{'trainer total':<30}{fmt(self.formula_trainer_total):>10}"
            + ("            formula" if m is not None else "")
        )
        if m is not None:
            lines.append(
                f"{'trainer total, measured':<30}{fmt(self.trainer_total):>10}            one "
                f"recipe step on fake tensors ({m.device} kernels, {m.seconds:.0f} s); "
                f"formula {self.tensor_total / m.peak - 1:+.1%}"
            )
        lines.extend(self._mode_lines(fmt, unit))
        lines.append(f"{'total':<30}{fmt(self.device_total):>10}{fmt(self.host_total):>10}")
        if any(not i.at_peak or i.phase not in ("all", self.peak_phase) for i in self.items):
            lines.append(
                f"* not alive at the trainer's peak (in the {self.peak_phase} phase: "
                + ("PPO updates" if self.peak_phase == "train" else "no-grad scoring passes")
                + ")"
            )
        if m is not None:
            kinds = ", ".join(
                f"{k.lower()} {fmt(v)}" for k, v in m.by_kind.items() if v and k != "Buffer"
            )
            lines.append(f"at the measured peak ({unit}, device and host): {kinds}")
            lines.append(
                "training phase from the measured step; generation phase and items from the "
                "formulas (the step does not generate)"
                if self.alternates
                else "totals and verdict from the measured step; items from the formulas"
            )
        if x.device == "cuda":
            lines.extend(self._estimate_lines())
        lines.append("")
        if self.fits is not None:
            gpu = x.gpu_mem_bytes or 0
            verdict = "FITS" if self.fits else "DOES NOT FIT"
            larger = ""
            if self.alternates:
                gen = self.generation_total() > self.training_total
                larger = f"; the larger phase: {'generation' if gen else 'training'}"
            lines.append(
                f"{verdict}: {fmt(self.device_total)} {unit} of {fmt(gpu)} {unit} per GPU "
                f"({fmt(gpu - self.device_total)} {unit} left{larger})"
            )
        if self.traffic:
            lines.extend(self._traffic_lines())
        big = ", ".join(f"{i.name} ({fmt(i.device)} {unit})" for i in self.biggest(3))
        lines.append(f"biggest: {big}")
        adv = self.advice()
        if adv:
            lines.append("switches that shrink them:")
            lines.extend(f"  - {a}" for a in adv)
        return "\n".join(lines)

    def _estimate_lines(self) -> list[str]:
        """Which figures of a GPU plan come from shapes (checked against real allocations on
        CPU) and which are estimates until a GPU run measures them (docs/memory.md)."""
        estimates = [
            f"CUDA context {_size(CUDA_CONTEXT_ESTIMATE_BYTES)}",
            f"allocator slack {_size(ALLOCATOR_SLACK_BYTES)}",
        ]
        if self.engine_after_release:
            estimates.append(f"engine after release {_size(self.engine_after_release)}")
        return [
            "from shapes, checked on CPU: parameters, gradients, optimizer states, activations, "
            "the fused loss's buffers, correction, no-grad passes",
            "estimates until a GPU run measures them: "
            + ", ".join(estimates)
            + "; pinned host blocks by the CUDA host allocator's power-of-two rule",
        ]

    def _forward_text(self) -> str:
        """One training forward, as the table's header says it."""
        x = self.inputs
        seq = f"seq_len {x.seq_len} ({x.response_len} response)"
        if x.micro_tokens is not None:
            return f"packed, {x.train_tokens} tokens per forward, {seq}"
        what = "packed" if x.packed else "padded"
        return f"{what}, micro_batch {x.micro_batch} x {seq}"

    def _traffic_lines(self) -> list[str]:
        """The bytes one training step sends across nodes under FSDP and HSDP, and what each
        costs per rank in device memory (several nodes only)."""
        x = self.inputs
        fsdp, hsdp = self.traffic["fsdp"], self.traffic["hsdp"]

        big = max(fsdp.total, *self.layout_totals.values()) >= GiB
        unit, div = ("GiB", GiB) if big else ("MiB", 2**20)  # MiB for the tiny CPU job

        def gib(n: float) -> str:
            return f"{n / div:.2f}"

        lines = [
            "",
            f"Across nodes per training step ({x.nnodes} nodes x {x.ranks_per_node} ranks; {unit} "
            "out of each node, as much comes in; NCCL ring model, docs/multinode.md):",
            f"{'':<48}{'fsdp':>10}{'hsdp':>10}",
        ]
        for (name, a), (_, b) in zip(fsdp.items, hsdp.items):
            lines.append(f"{name:<48}{gib(a):>10}{gib(b):>10}")
        lines.append(f"{'total per node':<48}{gib(fsdp.total):>10}{gib(hsdp.total):>10}")
        per_rank = x.ranks_per_node or 1
        lines.append(
            f"{'per rank (one NIC each)':<48}{gib(fsdp.total / per_rank):>10}"
            f"{gib(hsdp.total / per_rank):>10}"
        )
        split = {"fsdp": x.nnodes * per_rank, "hsdp": per_rank}
        lines.append(f"{'parameters split over (ranks)':<48}{split['fsdp']:>10}{split['hsdp']:>10}")
        if self.layout_totals:
            t = self.layout_totals
            lines.append(
                f"{f'device memory per rank, formula ({unit})':<48}{gib(t['fsdp']):>10}"
                f"{gib(t['hsdp']):>10}"
            )
        lines.append(f"this run: parallel.sharding={x.sharding}")
        return lines

    def _mode_lines(self, fmt: Any, unit: str) -> list[str]:
        """The device bytes of each phase of rollout.mode (GPU plans with an engine)."""
        engine = next((i.device for i in self.items if i.name.startswith("engine")), None)
        if engine is None:
            return []
        trainer = self.training_total
        if not self.alternates:
            return [
                f"rollout.mode=overlap: engine {fmt(engine)} + trainer {fmt(trainer - engine)} "
                f"{unit} at once (the engine generates while the trainer trains)"
            ]
        after = self.engine_after_release
        gen, gen_off = self.generation_total(False), self.generation_total(True)
        return [
            f"rollout.mode=alternate, rollout.offload_trainer="
            f"{str(self.inputs.offload_trainer).lower()}: engine and trainer take turns",
            f"{'  generation':<30}{fmt(gen):>10}{'':>10}  engine {fmt(engine)} + the trainer's "
            f"resident state {fmt(gen - engine)}",
            f"{'  generation, offload_trainer':<30}{fmt(gen_off):>10}"
            f"{fmt(int(self.offloaded * self.pinned_factor)):>10}  "
            "actor/critic parameters and optimizer states in pinned host memory",
            f"{'  training':<30}{fmt(trainer):>10}{'':>10}  the trainer's peak + engine after "
            f"release {fmt(after)} (its CUDA context: an estimate)",
        ]


def _size(n: int) -> str:
    """Bytes as GiB, or MiB below 0.1 GiB (notes of the table)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 10 else f"{n / 2**20:.2f} MiB"


def _model_items(
    name: str,
    args: Any,
    x: PlanInputs,
    spec: tuple[OptimizerSpec, int],
    *,
    value_head: bool,
    shapes: list[tuple[int, ...]] | None = None,
) -> tuple[list[PlanItem], ActivationBytes]:
    """Parameters, gradients, optimizer states (and the FSDP working set) of one model, and its
    activations; ``shapes``: its parameter shapes when the caller has them already."""
    W, m, c = x.world_size, x.master_bytes, x.compute_bytes
    if shapes is None:
        shapes = model_param_shapes(args, value_head=value_head)
    local = _local(shapes, W)
    P = sum(local)
    opt: StateBytes = optimizer_state_bytes(
        spec[0],
        local,
        param_bytes=m,
        minimal_size=spec[1],
        step_on_device=x.device == "cuda",
    )
    # CPUOffload's host states are pinned on CUDA runs
    pinned_extra = 0
    if x.device == "cuda" and spec[0].offload and opt.host:
        pinned_extra = int(opt.host * pinned_rounding(local)) - opt.host
    items = [
        PlanItem(
            f"{name} parameters",
            P * m,
            note=f"{_numel(shapes) / 1e6:,.1f}M params / {W} ranks",
            while_generating="offload",
        ),
        PlanItem(f"{name} gradients", P * m, phase="train", while_generating="freed"),
        PlanItem(
            f"{name} optimizer states",
            opt.device,
            opt.host + pinned_extra,
            note=_opt_note(spec[0]),
            while_generating="offload",
            pinned_extra=pinned_extra,
        ),
    ]
    if x.sharded:
        block = _numel(_block_shapes(args))
        root = _numel(shapes) - args.n_layers * block
        fsdp = (root + 2 * block) * c + root * (c + 4)
        items.append(
            PlanItem(
                f"{name} FSDP working set",
                fsdp,
                note="unsharded root + 2 blocks, root grads",
                while_generating="freed",
            )
        )
    act = activation_bytes(
        args,
        micro_batch=x.micro_batch,
        seq_len=x.seq_len,
        response_len=x.response_len,
        compute_bytes=c,
        checkpointing=x.activation_checkpointing,
        logits_chunk=x.logits_chunk,
        lm_head=not value_head,
        mask=x.mask,
        device=x.device,
        tokens=x.train_tokens,
        packed=x.packed,
        fused=not value_head,
    )
    return items, act


def _update_snapshot_item(items: list[PlanItem]) -> PlanItem:
    """``ppo.max_update_kl``: the copy of the actor's parameters and optimizer states taken before
    each actor step, and of the stepped parameters when the step is shortened, dropped after the
    step. It lives with the gradients, after the backward passes have freed their activations: of
    it and the training activations at the peak, only the larger counts."""
    named = {i.name: i for i in items}
    params, opt = named["actor parameters"], named["actor optimizer states"]
    snapshot = PlanItem(
        "actor update snapshot", 2 * params.device + opt.device, opt.host,
        note="ppo.max_update_kl: parameters before and after + optimizer states; "
        "instead of the activations",
        phase="train", while_generating="freed",
    )  # fmt: skip
    acts = [i for i in items if i.name.endswith("activations") and i.at_peak]
    if snapshot.device >= sum(i.device for i in acts):
        for i in acts:
            i.at_peak = False
    else:
        snapshot.at_peak = False
    return snapshot


def _opt_note(spec: OptimizerSpec) -> str:
    kind = {0: "fp m,v", 8: "8-bit m,v", 4: "4-bit m,v"}[spec.bits]
    return kind + (", offloaded to host" if spec.offload else "")


def plan_memory(x: PlanInputs) -> MemoryPlan:
    """The per-rank memory plan of ``x`` (see the module docstring for every formula)."""
    if x.world_size < 1:
        raise ValueError(f"world_size ({x.world_size}) must be >= 1")
    plan = MemoryPlan(inputs=x)
    W = x.world_size
    # the actor's shapes and local element count P serve the actor, reference, correction and
    # engine items
    actor_shapes = model_param_shapes(x.actor)
    P = sum(_local(actor_shapes, W))
    plan.actor_numel = P
    if x.device == "cuda":
        plan.pinned_factor = pinned_rounding(_local(actor_shapes, W))
    items, act = _model_items(
        "actor", x.actor, x, x.actor_optimizer, value_head=False, shapes=actor_shapes
    )
    plan.items += items
    acts = [("actor activations", act)]
    if x.critic is not None:
        items, cact = _model_items("critic", x.critic, x, x.critic_optimizer, value_head=True)
        plan.items += items
        acts.append(("critic activations", cact))
    # the other configuration of activation checkpointing, for the table's note
    alt = activation_bytes(
        x.actor,
        micro_batch=x.micro_batch,
        seq_len=x.seq_len,
        response_len=x.response_len,
        compute_bytes=x.compute_bytes,
        checkpointing=not x.activation_checkpointing,
        logits_chunk=x.logits_chunk,
        mask=x.mask,
        device=x.device,
        tokens=x.train_tokens,
        packed=x.packed,
        fused=True,
    )
    without = f"{'without' if x.activation_checkpointing else 'with'} AC: {_size(alt.total)}"
    largest = max(a.total for _, a in acts)
    counted = False
    for name, a in acts:
        peak = a.total == largest and not counted
        counted = counted or peak
        note = f"saved {_size(a.saved)} + backward transient {_size(a.transient)}"
        if name.startswith("actor"):
            note += f"; {without}"
        plan.items.append(
            PlanItem(
                name, a.total, note=note, at_peak=peak, phase="train", while_generating="freed"
            )
        )
    if x.reference:
        plan.items.append(PlanItem("reference model", P * x.master_bytes, note="frozen, sharded"))
    plan.items.append(_correction_item(x, P, plan.pinned_factor))
    if x.update_snapshot:
        plan.items.append(_update_snapshot_item(plan.items))
    plan.items.append(_scoring_item(x))
    if x.device == "cuda":
        if x.rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout_mode ({x.rollout_mode!r}) must be one of {ROLLOUT_MODES}")
        alternate = x.rollout_mode == "alternate"
        mode = "released while the trainer trains" if alternate else "generates while it trains"
        if x.engine_mem_fraction:
            gpu = x.gpu_mem_bytes or 0
            host = _numel(actor_shapes) * 2 if x.engine_weights_host_copy else 0
            plan.items.append(
                PlanItem(
                    "engine (mem_fraction)",
                    int(x.engine_mem_fraction * gpu),
                    host,
                    note=f"{x.engine_mem_fraction} x GPU: weights + KV cache; {mode}",
                    at_peak=not alternate,
                )
            )
        elif x.torch_engine is not None:
            t = x.torch_engine
            parts = torch_engine_bytes(x.actor, t)
            released = "moved to the host" if alternate else "generates while it trains"
            plan.items.append(
                PlanItem(
                    "engine (TorchEngine)",
                    sum(parts.values()),
                    note=f"weights {_size(parts['weights'])} + KV cache {_size(parts['kv_cache'])}"
                    f" ({t.rows} rows x {t.prompt_len + t.max_new_tokens} tokens) + working "
                    f"{_size(parts['working'])}; {released}"
                    + ("; its process's CUDA context not counted" if t.own_process else ""),
                    at_peak=not alternate,
                )
            )
        plan.items.append(
            PlanItem(
                "CUDA context + slack",
                CUDA_CONTEXT_BYTES,
                note="estimate: context 0.5 + allocator slack 0.5 GiB; NCCL without NVLS",
            )
        )
    if x.nnodes > 1 and x.step is not None:
        _add_traffic(plan)
    return plan


def _add_traffic(plan: MemoryPlan) -> None:
    """The cross-node bytes of a step under both shardings, and the per-rank device total of
    the other sharding (formula), for the table and the advice."""
    from dataclasses import replace

    from minippo.plan.network import cross_node_traffic

    x = plan.inputs
    scoring = []
    if x.reference:
        scoring.append(("reference", x.actor, False))
    if x.critic is not None:
        scoring.append(("critic", x.critic, True))
    scoring += [("correction", x.actor, False)] * x.correction.scoring_passes
    split = {"fsdp": x.nnodes * (x.ranks_per_node or 1), "hsdp": x.ranks_per_node or 1}
    for sharding, shard in split.items():
        plan.traffic[sharding] = cross_node_traffic(x, x.step, sharding, scoring_models=scoring)
        if sharding == x.sharding:
            plan.layout_totals[sharding] = plan.device_total
        else:
            other = plan_memory(replace(x, world_size=shard, sharding=sharding, step=None))
            plan.layout_totals[sharding] = other.device_total


def scoring_bytes(
    args: Any,
    *,
    rows: int,
    seq_len: int,
    response_len: int,
    compute_bytes: int,
    logits_chunk: int,
    lm_head: bool = True,
    mask: bool = True,
    tokens: int | None = None,
) -> int:
    """Working memory of one no-grad forward over ``rows`` sequences (N = rows · seq_len tokens;
    with ``tokens``, a packed forward of N = tokens real tokens and no mask): the largest set of
    intermediates alive at once, parameters excluded.

        attention phase   c·N·(3D + (H + 2H_kv)·hd + 5H·hd) + c·rows·S² (the additive mask bias)
        MLP phase         c·N·(3D + 3I)
        always            rows·S² (boolean mask) + 2·c·N·hd (RoPE cos/sin)
        lm_head (actor)   c·N·D + n·V·16, n = min(logits_chunk, rows · response_len)
    peak = max(attention, MLP, lm_head) + always. (Measured on CPU: exact when the MLP phase
    dominates, up to +40% when attention does.)
    """
    c, D, inter, hd = compute_bytes, args.dim, args.intermediate_size, args.head_dim
    H, Hkv, S = args.n_heads, args.n_kv_heads, seq_len
    N = rows * S if tokens is None else tokens
    scored = N * response_len // S
    attn = c * N * (3 * D + (H + 2 * Hkv) * hd + 5 * H * hd) + (c * rows * S * S if mask else 0)
    mlp = c * N * (3 * D + 3 * inter)
    head = c * N * D + min(logits_chunk, max(scored, 1)) * args.vocab_size * 16
    always = (rows * S * S if mask else 0) + 2 * c * N * hd
    return max(attn, mlp, head if lm_head else 0) + always


def _scoring_item(x: PlanInputs) -> PlanItem:
    """The no-grad passes of step 2 (reference logprobs, critic values, correction anchors), one
    model at a time over ``score_rows`` sequences per forward."""
    rows = x.score_rows or x.micro_batch
    tokens = None if x.score_tokens is None else max(x.score_tokens, x.seq_len)
    passes = []
    if x.correction.scoring_passes > 0 or x.reference:
        passes.append(("actor", x.actor, True))
    if x.critic is not None:
        passes.append(("critic", x.critic, False))
    if not passes:
        return PlanItem(
            "no-grad scoring passes", 0, phase="score", note="none", while_generating="freed"
        )
    sizes = {
        name: scoring_bytes(
            args,
            rows=rows,
            seq_len=x.seq_len,
            response_len=x.response_len,
            compute_bytes=x.compute_bytes,
            logits_chunk=x.logits_chunk,
            lm_head=head,
            mask=x.mask,
            tokens=tokens,
        )
        for name, args, head in passes
    }
    worst = max(sizes, key=sizes.get)
    per = f"{rows} sequences" if tokens is None else f"{tokens} tokens"
    return PlanItem(
        "no-grad scoring passes",
        sizes[worst],
        phase="score",
        note=f"{per} per forward ({worst} largest)",
        while_generating="freed",
    )


def pinned_rounding(local_numels: Iterable[int]) -> float:
    """Host bytes per byte asked when every tensor of these local element counts gets a pinned
    host copy: the CUDA host allocator (``CachingHostAllocator``) rounds each pinned block up to a
    power of two and keeps it cached for the process's life. The same for any element size that
    is a power of two (fp32, bf16, torchao's codes), so one factor serves parameters, their
    snapshots and optimizer states."""
    sizes = [n for n in local_numels if n > 0]
    if not sizes:
        return 1.0
    return sum(1 << (n - 1).bit_length() for n in sizes) / sum(sizes)


def _correction_item(x: PlanInputs, P: int, pinned: float = 1.0) -> PlanItem:
    """The weights the correction class declares it stores; ``P``: the actor's local parameter
    elements; ``pinned``: :func:`pinned_rounding` of its host copies (CUDA runs)."""
    c = x.correction
    name = f"correction ({c.name})"
    if not c.stored:
        return PlanItem(name, 0, note="no stored weights")
    device, host = c.bytes(P, x.master_bytes)
    parts = []
    for w in c.stored:
        dtype = "master dtype" if w.dtype is None else w.dtype
        where = "host" if w.storage == "cpu" else "device"
        parts.append(f"{w.what}: {w.copies} x {dtype}, {where}")
    extra = int(host * pinned) - host
    if extra:
        parts.append(f"host pinned: x{pinned:.2f} (power-of-two blocks)")
    return PlanItem(name, device, host + extra, note="; ".join(parts), pinned_extra=extra)
