"""The rollout-engine protocol: what the trainer asks of any generator.

Two backends implement it: :class:`minippo.engine.TorchEngine` (pure PyTorch, CPU or one GPU, the
embedded default) and ``SGLangEngine`` (GPU). The rollout queue and the recipe only ever talk to this
protocol, and ``tests/engine_suite.py`` runs the same protocol checks against every backend.

Building and weights. Every engine is built from the model config (``model_args``, a
:class:`minippo.models.ModelArgs`) and its compute dtype (``dtype``, the config key ``engine.dtype``),
never from a trainer's model: it starts without valid weights and refuses to generate until the
first ``publish_weights`` (the trainer publishes before its first request). ``dtype`` is the
engine's compute dtype as a ``torch.dtype``; the trainer casts what it publishes to it.

Weight versions. The engine holds one integer ``version`` (0 at start, unless the constructor says
otherwise). ``publish_weights(buckets, version)`` loads new weights and sets ``version``; every token sampled after the new weights are in place is stamped with that
version. Each generated token carries the version of the weights that computed its logits, so a
response that was paused, re-weighted and resumed (a partial rollout) carries several versions.

Tokens not sampled by the policy (the one marker convention, also in ``minippo/rl/types.py``).
An engine only ever returns sampled tokens: every version it stamps is >= 0. A multi-turn
trajectory (``minippo.env``) also holds observation tokens, written by an environment between
model turns; in a :class:`Completion` the rollout queue builds for such a trajectory they carry
version ``-1`` and logprob ``0.0``, and in a batch ``response_mask`` 0 (``versions == -1`` exactly
where ``response_mask == 0``; padding and observations differ only in ``attention_mask``). A
turn's request is the exact context so far (prompt, then every sampled and observation id); each
turn may carry its own ``stop_token_ids`` (the environment's stop ids per turn).

Logprobs. The logprob of a sampled token is ``log_softmax(logits / T)`` over the FULL vocabulary at
the request's temperature ``T`` (never renormalised for top-k / top-p). For greedy decoding
(``T == 0``) it is ``log_softmax(logits)`` (T = 1). This is what SGLang returns too, so the trainer
recomputes exactly the same quantity: ``minippo.models.token_logprobs(..., temperature=T)``.

Concurrency contract (both backends):
    * ``generate`` blocks until all its requests finish (or are aborted); it may be called from a
      background thread while another thread calls ``publish_weights`` / ``pause`` / ``resume`` /
      ``abort``. Several concurrent ``generate`` calls are allowed.
    * ``pause()`` returns once no forward pass is running; in-flight requests keep their tokens
      and their KV state. While paused, no token is produced (new ``generate`` calls wait).
    * ``publish_weights`` while paused applies the weights at once; ``resume()`` then continues the
      in-flight requests under the new weights. Without a pause, the weights take effect at a
      backend-defined point (TorchEngine: between two decode steps; SGLang: after the running
      requests finish). Either way, every token's version is exact.
    * ``abort()`` stops every in-flight request and returns their partial completions with
      ``finish_reason == "abort"``; the blocked ``generate`` calls return the same partial
      completions.
    * ``stream(requests, until_groups=k)`` yields completions as they finish, and with ``k`` stops
      the rest once ``k`` groups are complete (below). It may run beside ``generate`` calls.
    * ``sleep()`` / ``wake()`` release and restore the engine's memory (SGLang: the GPU's weights,
      KV cache and CUDA graphs; TorchEngine: its packed kernel weights on CPU, its model on a GPU).
      ``sleep`` requires an idle engine (no in-flight requests).

Streaming groups (what ``rollout.mode: alternate`` runs on). A request may name a ``group``; the
requests sharing one form a group (a request without one is a group of its own). ``stream``
yields each completion the moment it finishes (finishing order; requests that finish in the same
step come in request order). With ``until_groups=k``, once ``k`` groups of the call have every
request finished, the engine stops the call's other requests and yields them last, in request
order, as partial completions (``finish_reason == "abort"``; their tokens, logprobs and versions
so far are kept, and a request that never started has none). Only a group whose every request
has ``completes_group`` (the default) counts towards ``k``: a request with False is one that its
caller continues after it finishes (a model turn that an environment answers before the next),
so its group is not complete when it finishes and never counts. TorchEngine stops after the very
decode step that completed the ``k``-th group, so a seeded run is reproducible; SGLang stops them
as soon as its loop sees that completion (a few more tokens may come, each with its exact
version). A partial completion is continued later as a new request whose prompt is the old prompt
plus the generated tokens (what slime and miles call partial rollout): the engine keeps nothing
between calls, so it can sleep in between. Closing the iterator early aborts what is left.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from minippo.config import torch_dtype

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# One bucket of weights: (HF parameter name, full tensor) pairs.
WeightBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    Fields:
        temperature:    T >= 0. 0 means greedy (argmax); logits are divided by T otherwise.
        top_p:          nucleus sampling mass in (0, 1]; 1.0 = off.
        top_k:          keep the k most likely tokens; 0 = off.
        max_new_tokens: the response has at most this many tokens (>= 1).
        stop_token_ids: generation stops after sampling any of these ids (the stop token is
                        included in the response, with its logprob and version).
        seed:           per-request seed; the same request with the same seed and the same
                        weights gives the same tokens. None = drawn from the engine's generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        # accept any iterable of ids (a list from a YAML config), store an immutable tuple
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the bad value and the fix; return self when valid."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}; "
                "use e.g. temperature=1.0"
            )
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"top_p must be in (0, 1], got {self.top_p!r}; use top_p=1.0 to disable nucleus "
                "sampling"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}; use top_k=0 to "
                "disable it"
            )
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {m!r}")
        if any(tok < 0 for tok in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        return self


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete.

    Fields:
        prompt_ids: the prompt's token ids (unpadded), at least one.
        params:     sampling parameters.
        request_id: unique among the requests in flight; the completion carries it back.
        group:      requests of one ``stream`` call with the same group complete together (see
                    "Streaming groups"); None: the request is a group of its own.
        completes_group: whether this request finishing can complete its group in an
                    ``until_groups`` count: False when the caller continues the sample after it
                    (a turn that is not the episode's last), so its group never counts.
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    group: str | None = None
    completes_group: bool = True


@dataclass
class Completion:
    """The engine's answer to one request.

    Fields (R = number of generated tokens):
        request_id:    the request's id.
        prompt_ids:    the request's prompt ids.
        token_ids:     R generated token ids (including a final stop token, if one was sampled).
        logprobs:      R floats, log_softmax(logits / T)[token] over the full vocabulary.
        versions:      R ints, the weight version that sampled each token (>= 0 from an engine;
                       -1 marks an observation token in a multi-turn trajectory the queue built,
                       with logprob 0.0: see "Tokens not sampled by the policy").
        finish_reason: "stop" (a stop id was sampled), "length" (max_new_tokens reached) or
                       "abort" (stopped by abort() before it finished; the tokens so far are
                       kept). An "abort" completion is unfinished: it holds fewer than
                       max_new_tokens tokens and no stop id (:func:`settled_finish_reason`).
    """

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"completion {self.request_id!r}: token_ids ({n}), logprobs "
                f"({len(self.logprobs)}) and versions ({len(self.versions)}) must have the same "
                "length"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )

    @property
    def truncated(self) -> bool:
        """True when the response was cut by max_new_tokens."""
        return self.finish_reason == "length"


def settled_finish_reason(
    reason: str, token_ids: Sequence[int], params: SamplingParams, eos_ids: Iterable[int] = ()
) -> str:
    """The finish reason of a response, with an abort of a finished sample settled.

    An engine may stop a request in the very step in which it finished: SGLang 0.5.23 marks a
    running request it aborts finished and still runs one more decode step for it
    (``scheduler.py`` ~5800-5812, ``batch_result_processor.py`` ~1046), and checks the abort
    before the stop and length checks (``schedule_batch.py`` ~2011-2014), so its "abort" can end
    with a stop id or already hold ``max_new_tokens`` tokens. Such a sample is finished: this
    returns "stop" or "length" for it, as the engine would have said without the abort. The stop
    ids are the request's and, when it has any, ``eos_ids`` (an engine that also stops at the
    model's EOS ids, as SGLang does unless ``ignore_eos``). Any other reason is returned as it is.
    """
    if reason != "abort" or not token_ids:
        return reason
    stops = set(params.stop_token_ids)
    if stops:
        stops |= set(eos_ids)
    if token_ids[-1] in stops:
        return "stop"
    if len(token_ids) >= params.max_new_tokens:
        return "length"
    return reason


def validate_requests(
    requests: Sequence[GenerateRequest], *, max_seq_len: int | None, vocab_size: int | None = None
) -> None:
    """Check a batch of requests before any work is done; raise ValueError naming the problem.

    Every backend calls this first. ``max_seq_len`` is the engine's context length: a request
    needs ``len(prompt_ids) + max_new_tokens <= max_seq_len`` (None skips the length check).
    ``vocab_size``, when given, bounds the prompt ids: every id must be ``< vocab_size``.
    Request ids must be unique within the call.
    """
    seen: set[str] = set()
    for i, req in enumerate(requests):
        if not isinstance(req, GenerateRequest):
            raise TypeError(f"request {i} is a {type(req).__name__}, expected GenerateRequest")
        if len(req.prompt_ids) == 0:
            raise ValueError(
                f"request {i} ({req.request_id!r}) has an empty prompt; every request needs at "
                "least one prompt token (e.g. a BOS token)"
            )
        if any((not isinstance(t, int)) or t < 0 for t in req.prompt_ids):
            raise ValueError(f"request {i} ({req.request_id!r}): prompt ids must be ints >= 0")
        if vocab_size is not None:
            bad = [t for t in req.prompt_ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"request {i} ({req.request_id!r}): prompt ids {bad[:5]} are outside the "
                    f"vocabulary (vocab_size {vocab_size})"
                )
        try:
            req.params.validate()
        except ValueError as e:
            raise ValueError(f"request {i} ({req.request_id!r}): {e}") from None
        if max_seq_len is not None:
            n_prompt, n_new = len(req.prompt_ids), req.params.max_new_tokens
            if n_prompt + n_new > max_seq_len:
                raise ValueError(
                    f"request {i} ({req.request_id!r}): prompt length ({n_prompt}) + "
                    f"max_new_tokens ({n_new}) = {n_prompt + n_new} exceeds the engine's "
                    f"context length max_seq_len ({max_seq_len}); shorten the prompt or lower "
                    f"max_new_tokens to at most {max(max_seq_len - n_prompt, 0)}"
                )
        if req.request_id in seen:
            raise ValueError(f"request id {req.request_id!r} appears twice in one generate call")
        seen.add(req.request_id)


def compute_dtype(value: str | torch.dtype) -> torch.dtype:
    """The engine's compute dtype from ``engine.dtype``: a name in either spelling ("bf16" or
    "bfloat16", ...; :func:`minippo.config.torch_dtype`) or a ``torch.dtype``."""
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return torch_dtype(name, "engine.dtype")


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator the trainer can overlap with training. See the module docstring."""

    @property
    def version(self) -> int:
        """The weight version that the next sampled token will carry."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The engine's compute dtype (publish weights cast to it)."""
        ...

    @property
    def max_batch_size(self) -> int | None:
        """Rows decoded together in one wave, each to its end, before waiting rows start
        (TorchEngine); None: continuous batching (SGLang). Over-provisioned groups past the
        first wave then start only after it, so they carry no partial tokens (the recipe warns)."""
        ...

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete every request; block until done. Completions are in request order."""
        ...

    def stream(
        self, requests: Sequence[GenerateRequest], *, until_groups: int | None = None
    ) -> Iterator[Completion]:
        """Yield completions as they finish; with ``until_groups=k`` stop the rest once ``k``
        groups are complete and yield them as partial completions (module docstring)."""
        ...

    def publish_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load new weights, given as buckets of (HF name, full tensor); then set ``version``.

        A partial set of parameters is allowed (the others keep their values). The tied lm_head
        is not sent when embeddings are tied. ``version`` must not decrease. The call may return
        before the engine has applied the weights (TorchEngine does; SGLangEngine returns after),
        but never before it has read the buckets' tensors, and every request or control call
        made after it sees the new weights. A failed publish raises, in that call or in the next
        call of the engine, and the engine then refuses to generate until a publish succeeds.
        """
        ...

    def pause(self) -> None:
        """Stop producing tokens after the current step; in-flight requests keep their state."""
        ...

    def resume(self) -> None:
        """Continue the in-flight (and waiting) requests, with whatever weights are loaded now."""
        ...

    def abort(self) -> list[Completion]:
        """Stop all in-flight requests; return their partial completions (finish_reason abort)."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights, KV cache); requires no in-flight requests."""
        ...

    def wake(self) -> None:
        """Restore what ``sleep`` released.

        A backend that does not keep a host copy of the weights (SGLang without a CPU backup)
        needs a ``publish_weights`` after ``wake`` before generating; TorchEngine keeps them.
        """
        ...

    def shutdown(self) -> None:
        """Stop the engine and its processes; idempotent."""
        ...


class GroupCounter:
    """When a ``stream(requests, until_groups=k)`` call must stop (both backends use it).

    ``finish(i)`` records that request ``i`` of the call finished and returns True once ``k``
    groups have every request finished (``k`` None: never; the call runs to the end). A group
    with a request whose ``completes_group`` is False is never counted."""

    def __init__(self, requests: Sequence[GenerateRequest], until_groups: int | None) -> None:
        if until_groups is not None and (
            not isinstance(until_groups, int) or isinstance(until_groups, bool) or until_groups < 1
        ):
            raise ValueError(f"until_groups must be an integer >= 1 or None, got {until_groups!r}")
        self.until_groups = until_groups
        self._group_of: list[object] = [
            r.group if r.group is not None else ("request", i) for i, r in enumerate(requests)
        ]
        self._left: dict[object, int] = {}
        for key in self._group_of:
            self._left[key] = self._left.get(key, 0) + 1
        self._uncounted = {
            key for key, r in zip(self._group_of, requests, strict=True) if not r.completes_group
        }
        self.complete = 0  # groups counted complete

    def finish(self, index: int) -> bool:
        key = self._group_of[index]
        self._left[key] -= 1
        if self._left[key] == 0 and key not in self._uncounted:
            self.complete += 1
        return self.until_groups is not None and self.complete >= self.until_groups
