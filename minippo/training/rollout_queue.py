"""The rollout queue: generation in a background thread, bounded staleness, typed batches.

Version convention (the one every part of minippo uses):
    * the weights the run starts with are version 0;
    * training step ``s`` is numbered from 0; it trains the weights of version ``s`` and then
      publishes version ``s + 1`` (in 1-based counting: "after training step k the trainer
      publishes version k");
    * the batch consumed by step ``s`` (``queue.get_batch(s)``) contains only tokens with
      ``s - max_staleness <= v <= s``; the staleness of a token is ``s - v``. The queue refuses
      older tokens, as docs/corrections.md says: "refuses tokens older than step - max_staleness".
    * with ``sync_every = k > 1`` the trainer publishes after every k-th step, so versions count
      publishes: step ``s`` trains on data of version ``s // k`` or older, and every bound above
      reads ``s // k`` for ``s`` (the staleness of a token is ``s // k - v``, in versions);
    * ``max_staleness = 0`` is the synchronous loop: batch ``s`` is generated entirely by the
      weights of version ``s``, after they are published (same code path, no overlap).

Capacity control (AReaL-style, nothing is generated and then thrown away): batch ``s`` is assigned
its prompts and its generation is started only once the published version is at least
``s - max_staleness``. Versions never decrease, so every token of batch ``s`` then has
``v >= s - max_staleness``. Batches are delivered in order (batch ``s`` is always the prompts
``s * G ... s * G + G - 1``), so the data order is independent of timing, which makes runs
reproducible and resumable. The time the producer spends blocked by this bound is counted
(``rollout/capacity_wait_s``).

Partial rollouts (``partial_rollout=True``): ``publish`` pauses the engine, loads the new weights
and resumes it, so in-flight responses continue under the new weights and carry several versions
(each token its own). With ``partial_rollout=False``, ``publish`` first waits until the running
``generate`` call finishes (no response spans two versions), then publishes.

Usage (the recipe's whole interface)::

    queue = RolloutQueue(engine, prompts, groups_per_batch=8, samples_per_prompt=4,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=256),
                         max_staleness=1, reward_fn=my_reward)
    queue.start()
    for step in range(num_steps):
        rollouts = queue.get_batch(step)        # QueueBatch: .batch (RolloutBatch), .samples
        ...train on rollouts.batch...
        queue.publish(full_tensor_buckets(model, bucket_bytes=...), version=step + 1)
    queue.close()
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from minippo.engine.protocol import (
    Completion,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
)
from minippo.rl.correction import staleness_metrics
from minippo.rl.types import RolloutBatch

# seeds of individual requests: base * _SEED_STRIDE + global sample index (fits in int63)
_SEED_STRIDE = 1_000_003


def sample_seed(base: int, index: int) -> int:
    """The sampling seed of the request for global sample ``index`` of a run seeded ``base``
    (rollouts, the alternate schedule and evaluation alike)."""
    return (base * _SEED_STRIDE + index) % (1 << 62)


class PromptsExhausted(RuntimeError):
    """Raised by ``get_batch`` when the prompt source ran out before the requested batch."""


class RewardError(ValueError):
    """The reward function failed, or returned NaN, infinity or something that is not a number,
    for one sample (the message names the function and the prompt)."""


@dataclass
class RolloutSample:
    """One generated sample and what produced it.

    Fields:
        prompt:       the prompt item exactly as the prompt source yielded it (metadata such as
                      the reference answer travel with it).
        prompt_ids:   the prompt's token ids.
        completion:   the engine's completion (token ids, logprobs, versions, finish reason).
        text:         the decoded response (None when the queue has no ``decode``).
        reward:       the scalar reward (None when the queue has no ``reward_fn``).
        group:        index of the prompt within its batch (equals ``batch.group_ids[row]``).
        sample_index: global index of this sample since the start of training.
    """

    prompt: Any
    prompt_ids: list[int]
    completion: Completion
    text: str | None
    reward: float | None
    group: int
    sample_index: int


@dataclass
class QueueBatch:
    """What ``get_batch`` returns.

    Fields:
        step:    the training step the batch was made for.
        batch:   the tensors (RolloutBatch); ``rewards`` is filled when the queue has a
                 ``reward_fn``, else zeros for the trainer to fill.
        samples: one RolloutSample per row of ``batch``, in row order.
        metrics: ``rollout/`` statistics of this batch (floats).
    """

    step: int
    batch: RolloutBatch
    samples: list[RolloutSample]
    metrics: dict[str, float] = field(default_factory=dict)


def prompt_ids_of(item: Any) -> list[int]:
    """The token ids of a prompt item: ``item.prompt_ids``, ``item["prompt_ids"]`` or a list."""
    if isinstance(item, Mapping):
        if "prompt_ids" not in item:
            raise KeyError(f"prompt item has no 'prompt_ids' key (keys: {sorted(item)})")
        ids = item["prompt_ids"]
    elif hasattr(item, "prompt_ids"):
        ids = item.prompt_ids
    elif isinstance(item, (list, tuple)):
        ids = item
    else:
        raise TypeError(
            f"cannot read prompt ids from a {type(item).__name__}; yield objects with a "
            "prompt_ids attribute, dicts with a 'prompt_ids' key, or lists of token ids"
        )
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return [int(t) for t in ids]


def collate_completions(
    completions: list[Completion],
    group_ids: list[int],
    rewards: list[float] | None = None,
    *,
    pad_id: int = 0,
) -> RolloutBatch:
    """Pack completions into a RolloutBatch (prompt LEFT-padded | response RIGHT-padded).

    Shapes (B = len(completions), P = longest prompt, R = longest response, at least 1):
        input_ids int64 [B, P + R], attention_mask bool [B, P + R], position_ids int64 [B, P + R]
        (position of real token = number of real tokens before it; pads 0), response_mask
        float32 [B, R], rollout_logprobs float32 [B, R] (0 on pads), versions int64 [B, R]
        (-1 on pads), rewards float32 [B] (zeros when None), group_ids int64 [B], truncated bool [B].
    """
    if not completions:
        raise ValueError("collate_completions needs at least one completion")
    if len(group_ids) != len(completions):
        raise ValueError(f"{len(group_ids)} group ids for {len(completions)} completions")
    b = len(completions)
    p = max(len(c.prompt_ids) for c in completions)
    r = max(1, max(len(c.token_ids) for c in completions))
    # rows as padded Python lists, then one tensor per field (a per-row loop of tensor writes
    # costs ~60 µs a row, in the producer thread that shares the trainer's cores)
    ids, attend, response, logprobs_rows, versions_rows = [], [], [], [], []
    for c in completions:
        lp, lr = len(c.prompt_ids), len(c.token_ids)
        ids.append(
            [pad_id] * (p - lp) + list(c.prompt_ids) + list(c.token_ids) + [pad_id] * (r - lr)
        )
        attend.append([False] * (p - lp) + [True] * (lp + lr) + [False] * (r - lr))
        response.append([1.0] * lr + [0.0] * (r - lr))
        logprobs_rows.append(list(c.logprobs) + [0.0] * (r - lr))
        versions_rows.append(list(c.versions) + [-1] * (r - lr))
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(attend, dtype=torch.bool)
    response_mask = torch.tensor(response, dtype=torch.float32)
    logprobs = torch.tensor(logprobs_rows, dtype=torch.float32)
    versions = torch.tensor(versions_rows, dtype=torch.long)
    # position of a real token = count of real tokens before it; pads get 0
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0) * attention_mask
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        versions=versions,
        rewards=torch.tensor(rewards if rewards is not None else [0.0] * b, dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        truncated=torch.tensor([c.truncated for c in completions]),
    )


class QueueSettings:
    """What both rollout queues take (``RolloutQueue``'s Args), checked once."""

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: Iterable[Any],
        *,
        groups_per_batch: int,
        samples_per_prompt: int,
        sampling: SamplingParams | None,
        max_staleness: int,
        sync_every: int,
        partial_rollout: bool,
        reward_fn: Callable[[RolloutSample], float] | None,
        reward_name: str | None,
        decode: Callable[[list[int]], str] | None,
        pad_id: int,
        seed: int,
        initial_version: int | None,
    ) -> None:
        if not isinstance(groups_per_batch, int) or groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be an integer >= 1, got {groups_per_batch!r}")
        if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
            raise ValueError(
                f"samples_per_prompt must be an integer >= 1, got {samples_per_prompt!r}"
            )
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"max_staleness must be an integer >= 0 (0 = synchronous), got {max_staleness!r}"
            )
        self.engine = engine
        self.prompts = prompts
        self.groups_per_batch = groups_per_batch
        self.samples_per_prompt = samples_per_prompt
        self.sampling = (sampling or SamplingParams()).validate()
        self.max_staleness = max_staleness
        self.sync_every = _check_sync_every(sync_every)
        self.partial_rollout = bool(partial_rollout)
        self.reward_fn = reward_fn
        self.reward_name = reward_name or getattr(reward_fn, "__qualname__", repr(reward_fn))
        self.decode = decode
        self.pad_id = pad_id
        self.seed = int(seed)
        self._initial_version = initial_version

    MODE: str  # rollout.mode of the subclass, saved with its state

    def _oldest_allowed(self, step: int) -> int:
        """The oldest version a token of the batch of ``step`` may have."""
        return step // self.sync_every - self.max_staleness

    def _settings_state(self) -> dict[str, Any]:
        """The settings a saved queue state only makes sense with (part of ``state_dict``)."""
        return {
            "mode": self.MODE,
            "sync_every": self.sync_every,
            "samples_per_prompt": self.samples_per_prompt,
        }

    def _check_settings(self, state: Mapping[str, Any]) -> None:
        """Refuse a saved state whose settings differ from this queue's: versions count publishes
        (``rollout.sync_every``), and carried groups hold ``samples_per_prompt`` samples."""
        saved_mode = state.get("mode", "overlap")
        if saved_mode != self.MODE:
            raise ValueError(
                f"the checkpoint's rollout queue was saved with rollout.mode={saved_mode}; resume "
                f"with the same rollout.mode (this run has {self.MODE})"
            )
        for key, ours in self._settings_state().items():
            saved = state.get(key, ours)  # checkpoints written before the key was saved
            if key != "mode" and saved != ours:
                raise ValueError(
                    f"the checkpoint was written with rollout.{key}={saved}, this run has "
                    f"rollout.{key}={ours}: resume with rollout.{key}={saved}"
                )


class RolloutQueue(QueueSettings):
    """Feeds prompt groups to an engine from a background thread; hands out complete batches.

    Args:
        engine:             any RolloutEngine.
        prompts:            iterable of prompt items (see ``prompt_ids_of``); each becomes a group
                            of ``samples_per_prompt`` samples. Must be re-iterable in the same
                            order for ``load_state_dict`` (it skips the consumed prompts).
        groups_per_batch:   G, prompts per training batch (batch rows = G * samples_per_prompt).
        samples_per_prompt: n, samples per prompt (GRPO group size).
        sampling:           sampling parameters of every request; its ``seed`` is replaced per
                            request by ``seed * 1_000_003 + global sample index``.
        max_staleness:      the staleness bound (see the module docstring); 0 = synchronous.
        sync_every:         training steps per published version (``rollout.sync_every``).
        partial_rollout:    continue in-flight requests under new weights on ``publish``.
        reward_fn:          optional ``reward_fn(sample: RolloutSample) -> float``, run in the
                            background thread; without it rewards are zeros for the trainer to fill.
                            An exception, or a value that is not a finite number, stops the run
                            with a :class:`RewardError` naming the function and the prompt.
        reward_name:        the reward's name in those messages (default: ``reward_fn``'s).
        decode:             optional ``decode(token_ids) -> str`` (a tokenizer's decode) to fill
                            ``RolloutSample.text``.
        pad_id:             padding token id of the batch tensors.
        seed:               base of the per-request seeds.
        initial_version:    the version of the engine's weights at ``start`` (default: engine.version).
    """

    MODE = "overlap"

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: Iterable[Any],
        *,
        groups_per_batch: int,
        samples_per_prompt: int = 1,
        sampling: SamplingParams | None = None,
        max_staleness: int = 0,
        sync_every: int = 1,
        partial_rollout: bool = False,
        reward_fn: Callable[[RolloutSample], float] | None = None,
        reward_name: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
        pad_id: int = 0,
        seed: int = 0,
        initial_version: int | None = None,
    ) -> None:
        super().__init__(
            engine,
            prompts,
            groups_per_batch=groups_per_batch,
            samples_per_prompt=samples_per_prompt,
            sampling=sampling,
            max_staleness=max_staleness,
            sync_every=sync_every,
            partial_rollout=partial_rollout,
            reward_fn=reward_fn,
            reward_name=reward_name,
            decode=decode,
            pad_id=pad_id,
            seed=seed,
            initial_version=initial_version,
        )
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._exhausted_at: int | None = None  # first slot that could not be filled
        self._ready: dict[int, QueueBatch] = {}
        self._version = 0
        self._next_step = 0  # the step the trainer asks for next
        self._next_slot = 0  # the batch the producer generates next
        self._generating = False
        # the version the batch in hand started with, from taking its prompts until it is in
        # _ready (generation, then reward scoring and collation): its tokens are referenced
        self._unqueued_version: int | None = None
        self._held = False  # engine_idle(): the producer starts nothing
        self._prompt_iter: Iterator[Any] | None = None
        # cumulative counters (exposed by metrics())
        self._capacity_waits = 0
        self._capacity_wait_s = 0.0
        self._drain_wait_s = 0.0
        self._tokens_generated = 0
        self._gen_time_s = 0.0
        self._delivered = (0, 0.0)  # tokens and generation seconds of the batches handed out

    # ------------------------------------------------------------------ trainer API
    def start(self) -> None:
        """Start the background producer (after ``load_state_dict`` when resuming)."""
        if self._thread is not None:
            raise RuntimeError("RolloutQueue.start() was called twice")
        self._version = (
            int(self._initial_version)
            if self._initial_version is not None
            else int(self.engine.version)
        )
        self._prompt_iter = iter(self.prompts)
        # resume: skip the prompts of the consumed steps and of a batch restored by load_state_dict
        self._next_slot = self._next_step + (1 if self._next_step in self._ready else 0)
        for _ in range(self._next_slot * self.groups_per_batch):
            if next(self._prompt_iter, _END) is _END:
                raise PromptsExhausted(
                    f"cannot resume at step {self._next_step}: the prompt source has fewer than "
                    f"{self._next_slot * self.groups_per_batch} prompts"
                )
        self._thread = threading.Thread(target=self._produce, name="rollout-queue", daemon=True)
        self._thread.start()

    def get_batch(self, step: int, timeout: float | None = None) -> QueueBatch:
        """Block until the batch of training step ``step`` (0-based) is complete; return it.

        Steps must be requested in order. Raises PromptsExhausted when the prompts ran out,
        re-raises any error of the background thread, and raises RuntimeError if a token violates
        the staleness bound (which the capacity control makes impossible; it is checked anyway).
        """
        if self._thread is None:
            raise RuntimeError("call RolloutQueue.start() before get_batch()")
        if step != self._next_step:
            raise ValueError(
                f"get_batch(step={step}) out of order: the next batch is for step "
                f"{self._next_step}; steps are consumed one by one from 0 (or the resumed step)"
            )
        t0 = time.perf_counter()
        with self._cond:
            self._wait_ready(step, None if timeout is None else t0 + timeout)
            out = self._ready.pop(step)
            self._next_step = step + 1
            tokens, gen_s = self._delivered
            self._delivered = (
                tokens + int(out.metrics["rollout/tokens"]),
                gen_s + out.metrics["rollout/gen_time_s"],
            )
            self._cond.notify_all()
        out.metrics.update(
            check_staleness(out.batch, self._oldest_allowed(step), step // self.sync_every)
        )
        out.metrics["rollout/wait_s"] = time.perf_counter() - t0
        out.metrics.update(self.metrics())
        return out

    def _wait_ready(self, step: int, deadline: float | None) -> None:
        """Wait (holding ``self._cond``) until the batch of ``step`` is ready; raise when it
        cannot come (producer error, prompts exhausted, weights not published, queue closed)."""
        timeout = None if deadline is None else deadline - time.perf_counter()
        while step not in self._ready:
            if self._error is not None:
                raise RuntimeError("the rollout producer thread failed") from self._error
            if self._exhausted_at is not None and step >= self._exhausted_at:
                raise PromptsExhausted(
                    f"the prompt source ran out before the batch of step {step} was filled"
                )
            if self._version < self._oldest_allowed(step):
                raise RuntimeError(
                    f"get_batch(step={step}) with max_staleness={self.max_staleness} needs "
                    f"weights of version >= {self._oldest_allowed(step)} published first "
                    f"(queue.publish or queue.on_weights_published); latest is {self._version}"
                )
            if self._stop:
                raise RuntimeError("the rollout queue was closed")
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no batch for step {step} after {timeout:.3g} s")
            self._cond.wait(timeout=remaining if remaining is not None else 1.0)

    def publish(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Push new weights into the engine and record ``version`` (see partial_rollout)."""
        if version < self._version:
            raise ValueError(f"version must not decrease: got {version}, have {self._version}")
        if self.partial_rollout:
            self.engine.pause()
            try:
                self.engine.publish_weights(buckets, version)
            finally:
                self.engine.resume()
        else:
            t0 = time.perf_counter()
            with self.engine_idle():
                self._drain_wait_s += time.perf_counter() - t0
                self.engine.publish_weights(buckets, version)
        self.on_weights_published(version)

    @contextmanager
    def engine_idle(self) -> Iterator[None]:
        """Inside the block the queue has nothing in the engine: the running ``generate`` call
        has finished and the producer starts no new one until the block ends (to publish, or to
        run an evaluation that must not share the engine with training rollouts)."""
        with self._cond:
            self._held = True
            while self._generating and self._error is None:
                self._cond.wait(timeout=1.0)
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def on_weights_published(self, version: int) -> None:
        """Record that the engine now holds ``version`` (when weights were pushed elsewhere)."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"version must not decrease: got {version}, have {self._version}")
            self._version = int(version)
            self._cond.notify_all()

    def referenced_versions(self) -> set[int]:
        """The weight versions that tokens of the ready batches and of the batch in hand (being
        generated, or already generated and being scored and collated) may carry: what
        keep_old_actor must keep a snapshot of, besides the latest."""
        with self._cond:
            lows = [
                int(b.batch.versions[b.batch.versions >= 0].min())
                for b in self._ready.values()
                if bool((b.batch.versions >= 0).any())
            ]
            if self._unqueued_version is not None:
                lows.append(self._unqueued_version)
            return set(range(min(lows, default=self._version), self._version + 1))

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/`` counters since start."""
        return {
            "rollout/capacity_waits": float(self._capacity_waits),
            "rollout/capacity_wait_s": self._capacity_wait_s,
            "rollout/publish_drain_wait_s": self._drain_wait_s,
            "rollout/tokens_total": float(self._tokens_generated),
            "rollout/tokens_per_s_total": self._tokens_generated / max(self._gen_time_s, 1e-9),
            "rollout/buffered_batches": float(len(self._ready)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Resume position, and the batch generated ahead of training.

        The next step's batch is (being) generated with weights older than the ones a checkpoint
        saves now, which a resumed run could not rebuild: this waits for that batch and saves it
        (it stays queued here too). A resumed run then trains on the very same tokens and its
        producer continues with the step after it. Before ``start`` nothing is ahead.
        """
        ahead = None
        with self._cond:
            if self._thread is not None and self._exhausted_at != self._next_step:
                self._wait_ready(self._next_step, None)
                ahead = self._ready[self._next_step]
        # counters of the batches a resumed run will not generate again: the ones handed out
        # and the one ahead (not a later one that may already be generated meanwhile)
        tokens, gen_s = self._delivered
        if ahead is not None:
            tokens += int(ahead.metrics["rollout/tokens"])
            gen_s += ahead.metrics["rollout/gen_time_s"]
        return {
            **self._settings_state(),
            "next_step": self._next_step,
            "prompts_consumed": self._next_step * self.groups_per_batch,
            "seed": self.seed,
            "batch_ahead": ahead,
            "tokens_total": tokens,  # the cumulative counters continue on resume
            "gen_time_s": gen_s,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; call before ``start``."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        self._check_settings(state)
        if state["prompts_consumed"] != state["next_step"] * self.groups_per_batch:
            raise ValueError(
                f"checkpoint consumed {state['prompts_consumed']} prompts in "
                f"{state['next_step']} steps, which does not match groups_per_batch="
                f"{self.groups_per_batch}"
            )
        self._next_step = int(state["next_step"])
        self.seed = int(state["seed"])
        self._tokens_generated = int(state.get("tokens_total", 0))
        self._gen_time_s = float(state.get("gen_time_s", 0.0))
        self._delivered = (self._tokens_generated, self._gen_time_s)
        if state["batch_ahead"] is not None:  # counted again when it is handed out
            m = state["batch_ahead"].metrics
            self._delivered = (
                self._tokens_generated - int(m["rollout/tokens"]),
                self._gen_time_s - m["rollout/gen_time_s"],
            )
        self._ready.clear()
        if state["batch_ahead"] is not None:
            self._ready[self._next_step] = state["batch_ahead"]

    def close(self) -> None:
        """Stop the producer (aborting its in-flight requests) and join it. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is None:
            return
        deadline = time.perf_counter() + 60.0
        while self._thread.is_alive():
            with self._cond:
                generating = self._generating
            if generating:  # unblock the producer's generate call
                self.engine.abort()
            self._thread.join(timeout=0.2)
            if time.perf_counter() > deadline:
                raise RuntimeError("the rollout producer thread did not stop within 60 s")

    def __enter__(self) -> RolloutQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ producer
    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    slot = self._next_slot
                    t0 = time.perf_counter()
                    # capacity: start batch `slot` only when its tokens cannot become too stale
                    waited = self._version < self._oldest_allowed(slot)
                    self._capacity_waits += int(waited)
                    while not self._stop and (
                        self._version < self._oldest_allowed(slot) or self._held
                    ):
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    if waited:
                        self._capacity_wait_s += time.perf_counter() - t0
                    start_version = self._version
                    items = self._take_prompts()
                    if items is None:
                        self._exhausted_at = slot
                        self._cond.notify_all()
                        return
                    self._generating = True
                    self._unqueued_version = start_version
                requests, owners = self._requests(slot, items)
                t_gen = time.perf_counter()
                try:
                    completions = self.engine.generate(requests)
                finally:
                    with self._cond:
                        self._generating = False
                        self._cond.notify_all()
                gen_s = time.perf_counter() - t_gen
                if self._stop:
                    return
                batch = self._assemble(slot, items, owners, completions, gen_s, start_version)
                with self._cond:
                    self._ready[slot] = batch
                    self._unqueued_version = None
                    self._next_slot = slot + 1
                    self._cond.notify_all()
        except BaseException as e:  # surfaced by get_batch in the trainer's thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _take_prompts(self) -> list[Any] | None:
        assert self._prompt_iter is not None
        items = []
        for _ in range(self.groups_per_batch):
            item = next(self._prompt_iter, _END)
            if item is _END:
                return None
            items.append(item)
        return items

    def _requests(self, slot: int, items: list[Any]) -> tuple[list[GenerateRequest], list[int]]:
        n = self.samples_per_prompt
        requests, owners = [], []
        first = slot * self.groups_per_batch * n  # global index of the batch's first sample
        for g, item in enumerate(items):
            ids = prompt_ids_of(item)
            for j in range(n):
                idx = first + g * n + j
                params = replace(self.sampling, seed=sample_seed(self.seed, idx))
                requests.append(GenerateRequest(ids, params, request_id=f"s{slot}-g{g}-n{j}"))
                owners.append(g)
        return requests, owners

    def _assemble(
        self,
        slot: int,
        items: list[Any],
        owners: list[int],
        completions: list[Completion],
        gen_s: float,
        start_version: int,
    ) -> QueueBatch:
        n = self.samples_per_prompt
        first = slot * self.groups_per_batch * n
        samples: list[RolloutSample] = []
        for i, (g, c) in enumerate(zip(owners, completions)):
            if c.finish_reason == "abort":
                raise RuntimeError(
                    f"request {c.request_id} was aborted (by engine.abort() outside the queue); "
                    "the queue cannot build a batch from partial completions"
                )
            sample = RolloutSample(
                prompt=items[g],
                prompt_ids=list(c.prompt_ids),
                completion=c,
                text=self.decode(c.token_ids) if self.decode is not None else None,
                reward=None,
                group=g,
                sample_index=first + i,
            )
            if self.reward_fn is not None:
                sample.reward = score_sample(self.reward_fn, self.reward_name, sample)
            samples.append(sample)
        rewards = [s.reward for s in samples] if self.reward_fn is not None else None
        batch = collate_completions(completions, owners, rewards, pad_id=self.pad_id)
        metrics = batch_metrics(batch, gen_s, has_rewards=rewards is not None)
        metrics["rollout/start_version"] = float(start_version)
        self._tokens_generated += int(metrics["rollout/tokens"])
        self._gen_time_s += gen_s
        return QueueBatch(step=slot, batch=batch, samples=samples, metrics=metrics)


def score_sample(
    reward_fn: Callable[[RolloutSample], float], reward_name: str, sample: RolloutSample
) -> float:
    """``reward_fn(sample)`` as a float; a RewardError naming the reward and the prompt when it
    raises or returns NaN, infinity or a non-number."""
    where = _describe_prompt(sample)
    try:
        value = reward_fn(sample)
    except Exception as e:
        raise RewardError(
            f"reward {reward_name} raised {type(e).__name__} ({e}) for {where}"
        ) from e
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()  # a 0-dim tensor or a numpy scalar
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"reward {reward_name} returned {value!r} (a {type(value).__name__}) for {where}; a "
            "reward must return a number"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward {reward_name} returned {value} for {where}; a reward must be finite (this "
            "is the reward, not the loss: check the reward function)"
        )
    return float(value)


def batch_metrics(
    batch: RolloutBatch, gen_s: float, *, has_rewards: bool, generated: int | None = None
) -> dict[str, float]:
    """``rollout/`` statistics of one batch generated in ``gen_s`` seconds; ``generated``: the
    tokens the engine produced in that time (default: the batch's response tokens; fewer when
    some were carried over from earlier steps, more when it also produced tokens for later)."""
    lengths = batch.response_mask.sum(dim=1, dtype=torch.float64)
    n_tokens = int(lengths.sum())
    generated = n_tokens if generated is None else generated
    valid = batch.versions >= 0
    low = torch.where(valid, batch.versions, batch.versions.max() + 1).amin(dim=1)
    spans = (valid & (batch.versions != low[:, None])).any(dim=1)  # tokens of 2+ versions
    metrics = {
        "rollout/tokens_per_s": generated / max(gen_s, 1e-9),
        "rollout/gen_time_s": gen_s,
        "rollout/tokens": float(n_tokens),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_min": float(lengths.min()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(batch.truncated.float().mean()),
        "rollout/multi_version_fraction": float(spans.float().mean()),
    }
    if has_rewards:
        metrics["rollout/reward_mean"] = float(batch.rewards.mean())
    return metrics


def check_staleness(batch: RolloutBatch, oldest: int, current: int) -> dict[str, float]:
    """Raise RuntimeError if a token of the batch is older than version ``oldest`` or newer than
    ``current`` (the version its step trains from); return the ``rollout/staleness_*``
    statistics (``current − v`` over tokens)."""
    versions = batch.versions
    real = versions[versions >= 0]
    if real.numel() and (int(real.min()) < oldest or int(real.max()) > current):
        raise RuntimeError(
            f"staleness bound violated: token versions [{int(real.min())}, {int(real.max())}], "
            f"allowed [{oldest}, {current}] (the step trains from version {current})"
        )
    return staleness_metrics(versions, versions >= 0, current, prefix="rollout/")


def _check_sync_every(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"rollout.sync_every must be an integer >= 1, got {value!r}")
    return value


def _describe_prompt(sample: RolloutSample) -> str:
    """``prompt 12 ('3012=')``: the prompt's dataset index (if it has one) and text, shortened."""
    item = sample.prompt
    index = getattr(item, "index", None)
    text = getattr(item, "prompt", None)
    text = text if isinstance(text, str) else None
    head = f"prompt {index}" if index is not None else f"sample {sample.sample_index}"
    if text is not None:
        short = text if len(text) <= 60 else text[:57] + "..."
        head += f" ({short!r})"
    return f"{head}, completion {(sample.text or '')[:60]!r}"


_END = object()
