"""The rollout queue: prompt groups in, typed batches of bounded staleness out, on one of two
schedules (``rollout.mode``).

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
      weights of version ``s``, after they are published.

Every sample is an episode of model turns; a single-turn sample is the one-turn case (no
environment, max_turns 1: its one turn is the whole response, and the reward function scores its
end). Both schedules take prompts in order as groups (one prompt, ``samples_per_prompt`` samples,
each seeded ``seed * 1_000_003 + global sample index``), build the request of each unfinished
episode's current turn, merge each completion into its sample, score the episodes once they
ended and collate the groups of a batch in submission order. They differ in when generation runs:

``overlap``: a producer thread generates ahead while the trainer trains. Capacity control
(AReaL-style, nothing is generated and then thrown away): batch ``s`` is assigned its prompts
(always ``s * G ... s * G + G - 1``) and started only once the published version is at least
``s - max_staleness``; versions never decrease, so every token of it then has
``v >= s - max_staleness``, and the data order does not depend on timing. Blocked time is counted
(``rollout/capacity_wait_s``). With ``partial_rollout=True``, ``publish`` pauses the engine,
loads the weights and resumes it, so in-flight responses continue under the new weights and carry
several versions (each token its own); without, ``publish`` first waits until the running
``generate`` call finishes.

``alternate`` (a GPU shared by engine and trainer): nothing generates while the trainer trains.
``publish`` wakes the engine and pushes the weights; ``get_batch`` streams the requests of up to
``ceil(G × oversample)`` groups until G are complete, stops the others where they are (mid-turn),
sleeps the engine and returns the first G to complete. The stopped groups are carried into the
next step with their tokens (and environment state) and continue under the next weights, as
requests whose prompt is the old one plus the tokens so far (partial rollouts, slime/miles
style). A carried sample whose oldest token would break the bound restarts from its prompt
(``rollout/restarted``); with ``partial_rollout=False`` every unfinished carried sample does.
With TorchEngine, whose stops are exact and whose requests are seeded, a run is reproducible and
resumes exactly.

Multi-turn episodes (``multi_turn``, docs/multi_turn.md): a sample is an episode of an
environment. Each model turn is a request whose prompt is the exact context so far; the
environment's answers (run concurrently, under a timeout) append observation tokens, marked
version -1 with logprob 0 (response_mask 0 in the batch), until it ends the episode with its
reward. Both schedules run every episode in rounds of one turn per unfinished episode, then the
environment's answers; overlap runs a batch's rounds until its episodes ended, alternate until G
groups are complete. A round's stream stops early only once enough groups complete whose every
unfinished episode is on a turn that is certainly its last (max_turns reached, or one token of
the budget left: every single-turn request), so the other episodes are cut mid-turn and carried
with their environment state (saved with the queue's state).

Usage (the recipe's whole interface)::

    queue = RolloutQueue(engine, prompts, groups_per_batch=8, samples_per_prompt=4,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=256),
                         max_staleness=1, reward_fn=my_reward, mode="overlap")
    queue.start()
    for step in range(num_steps):
        rollouts = queue.get_batch(step)        # QueueBatch: .batch (RolloutBatch), .samples
        ...train on rollouts.batch...
        queue.publish(full_tensor_buckets(model, bucket_bytes=...), version=step + 1)
    queue.close()
"""

from __future__ import annotations

import hashlib
import itertools
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
    settled_finish_reason,
)
from minippo.env import ON_ERROR, EnvError, EnvRunner, Fault, MultiTurn, StepResult, Turn
from minippo.rl.correction import staleness_metrics
from minippo.rl.types import RolloutBatch
from minippo.training.placement import ROLLOUT_MODES

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
        turns:        model turns of a multi-turn episode (1 for a single-turn sample).
    """

    prompt: Any
    prompt_ids: list[int]
    completion: Completion
    text: str | None
    reward: float | None
    group: int
    sample_index: int
    turns: int = 1


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
        A response token with version -1 (an observation of a multi-turn episode: not sampled by
        the policy) is attended to (attention_mask True, a position of its own) and gets
        response_mask 0 (the convention of ``rl/types.py``).
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
        response.append([1.0 if v >= 0 else 0.0 for v in c.versions] + [0.0] * (r - lr))
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


@dataclass
class _Sample:
    """One sample of a group: an episode (one turn without an environment) and its tokens."""

    seed: int
    done: Completion | None = None  # the tokens so far: None before the first, then
    # finish_reason "abort" until the episode ends
    reward: float | None = None
    attempt: int = 0  # restarts from the prompt
    episode: _Episode | None = None  # None until it starts (env.reset) or restarts

    @property
    def finished(self) -> bool:
        return self.episode is not None and self.episode.ended

    @property
    def oldest_version(self) -> int | None:
        """The oldest version of its sampled tokens (observation tokens, version -1, have none)."""
        if self.done is None:
            return None
        sampled = [v for v in self.done.versions if v >= 0]
        return min(sampled) if sampled else None


@dataclass
class _Episode:
    """A sample's episode: the environment's state (None without one) and where its turns are.

    ``turn_start`` indexes the sample's response tokens where the current model turn begins;
    the tokens before it are earlier turns and observations (version -1)."""

    state: Any
    turns: int = 0  # model turns answered by the environment
    turn_start: int = 0
    obs_tokens: int = 0
    ended: bool = False
    truncated: bool = False  # a budget (turns, tokens) ended it, or cut its last observation
    obs_cut: bool = False  # an observation was cut to fit the response budget
    fault: str | None = None  # "timeout" or "error": ended with reward 0 (on_error=zero_reward)
    reward: float | None = None  # the environment's reward (None: the reward component's)


@dataclass
class _Group:
    """One prompt and its samples, from submission until it is trained on."""

    index: int  # global submission order since the start of training
    prompt: Any
    prompt_ids: list[int]
    samples: list[_Sample]
    completed_at: tuple[int, int] | None = None  # (step, order within the step) when complete

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)


class RolloutQueue:
    """Prompt groups in, complete batches out, under either schedule (``rollout.mode``).

    Args:
        engine:             any RolloutEngine.
        prompts:            iterable of prompt items (see ``prompt_ids_of``); each becomes a group
                            of ``samples_per_prompt`` samples. Must be re-iterable in the same
                            order for ``load_state_dict`` (it skips the prompts already taken).
        groups_per_batch:   G, prompts per training batch (batch rows = G * samples_per_prompt).
        samples_per_prompt: n, samples per prompt (GRPO group size).
        sampling:           sampling parameters of every request; its ``seed`` is replaced per
                            request by ``seed * 1_000_003 + global sample index``.
        max_staleness:      the staleness bound (see the module docstring); 0 = synchronous.
        sync_every:         training steps per published version (``rollout.sync_every``).
        partial_rollout:    overlap: continue in-flight requests under new weights on
                            ``publish``; alternate: continue carried samples (else they restart).
        mode:               "overlap" (a producer thread generates ahead) or "alternate"
                            (``get_batch`` generates, then the engine sleeps).
        oversample:         alternate: groups in flight = ``ceil(G × oversample)`` (>= 1); the
                            first G to complete make the batch, the others are carried.
        sleep:              alternate: sleep the engine after each batch, wake it on ``publish``.
        reward_fn:          optional ``reward_fn(sample: RolloutSample) -> float``, run where the
                            samples finish; without it rewards are zeros for the trainer to fill.
                            An exception, or a value that is not a finite number, stops the run
                            with a :class:`RewardError` naming the function and the prompt.
        reward_name:        the reward's name in those messages (default: ``reward_fn``'s).
        decode:             optional ``decode(token_ids) -> str`` (a tokenizer's decode) to fill
                            ``RolloutSample.text``.
        pad_id:             padding token id of the batch tensors.
        seed:               base of the per-request seeds.
        initial_version:    the version of the engine's weights at ``start`` (default: engine.version).
        multi_turn:         None: single-turn samples (episodes of one turn, the whole
                            response, scored by ``reward_fn``). Else every sample is an episode of
                            ``multi_turn.env`` (:class:`minippo.env.MultiTurn`): turns, each ended
                            by a stop id or the per-turn cap, answered by the environment with
                            observation tokens (version -1, response_mask 0) until it ends the
                            episode; ``sampling.max_new_tokens`` bounds the whole response, model
                            and observation tokens. Overlap runs a batch's episodes to their end
                            (a publish with partial rollouts re-weights them mid-turn); alternate
                            runs rounds of one turn per unfinished episode until
                            ``groups_per_batch`` groups are complete and carries the others, with
                            their environment state and partial turns, into the next step.
    """

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
        mode: str = "overlap",
        oversample: float = 1.0,
        sleep: bool = True,
        reward_fn: Callable[[RolloutSample], float] | None = None,
        reward_name: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
        pad_id: int = 0,
        seed: int = 0,
        initial_version: int | None = None,
        multi_turn: MultiTurn | None = None,
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
        if mode not in ROLLOUT_MODES:
            raise ValueError(
                f"rollout.mode must be one of {', '.join(ROLLOUT_MODES)}, got {mode!r}"
            )
        if not (isinstance(oversample, int | float) and math.isfinite(oversample)) or (
            oversample < 1
        ):
            raise ValueError(f"rollout.oversample must be a number >= 1.0, got {oversample!r}")
        if mode == "overlap" and oversample != 1:
            raise ValueError(
                f"rollout.oversample={oversample} needs rollout.mode=alternate (groups carried "
                "between steps); set rollout.mode=alternate or rollout.oversample=1.0"
            )
        self.engine = engine
        self.prompts = prompts
        self.groups_per_batch = groups_per_batch
        self.samples_per_prompt = samples_per_prompt
        self.sampling = (sampling or SamplingParams()).validate()
        self.max_staleness = max_staleness
        self.sync_every = _check_sync_every(sync_every)
        self.partial_rollout = bool(partial_rollout)
        self.mode = mode
        self.in_flight = math.ceil(groups_per_batch * oversample - 1e-9)  # groups per step
        self.sleep = bool(sleep) and mode == "alternate"
        self.reward_fn = reward_fn
        self.reward_name = reward_name or getattr(reward_fn, "__qualname__", repr(reward_fn))
        self.decode = decode
        self.pad_id = pad_id
        self.seed = int(seed)
        self._initial_version = initial_version
        self._version = 0
        self._next_step = 0  # the step the trainer asks for next
        self._groups_taken = 0  # prompts taken from the source since the start of training
        self._groups: list[_Group] = []  # alternate: carried into the next step, in order
        self._prompt_iter: Iterator[Any] | None = None
        self._started = False
        self._asleep = False
        # overlap: the producer thread and the batches it generated ahead
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._exhausted_at: int | None = None  # first slot that could not be filled
        self._ready: dict[int, QueueBatch] = {}
        self._next_slot = 0  # the batch the producer generates next
        self._generating = False
        # the version the batch in hand started with, from taking its prompts until it is in
        # _ready (generation, then reward scoring and collation): its tokens are referenced
        self._unqueued_version: int | None = None
        self._held = False  # engine_idle(): the producer starts nothing
        # cumulative counters (exposed by metrics())
        self._capacity_waits = 0
        self._capacity_wait_s = 0.0
        self._drain_wait_s = 0.0
        self._tokens_generated = 0
        self._gen_time_s = 0.0
        self._delivered = (0, 0.0)  # tokens and generation seconds of the batches handed out
        self._restarted_total = 0
        self._wake_s = 0.0  # of the last publish, reported with the next batch
        self.multi_turn = multi_turn
        self._runner: EnvRunner | None = None
        self._env_faults = {"timeout": 0, "error": 0}  # cumulative, zero_reward outcomes
        # turns: without an environment one, the whole response, ending at the run's stop ids
        self._max_turns = 1
        self._turn_tokens = self.sampling.max_new_tokens
        self._turn_stops = self.sampling.stop_token_ids
        if multi_turn is not None:
            if multi_turn.on_error not in ON_ERROR:
                raise ValueError(
                    f"multi_turn.on_error must be one of {', '.join(ON_ERROR)}, got "
                    f"{multi_turn.on_error!r}"
                )
            if multi_turn.max_turn_tokens < 1 or multi_turn.max_turns < 1:
                raise ValueError(
                    f"multi_turn.max_turns ({multi_turn.max_turns}) and multi_turn."
                    f"max_turn_tokens ({multi_turn.max_turn_tokens}) must be >= 1"
                )
            self._runner = EnvRunner(
                multi_turn.name, workers=multi_turn.workers, timeout_s=multi_turn.step_timeout_s
            )
            self._max_turns = multi_turn.max_turns
            self._turn_tokens = multi_turn.max_turn_tokens
            stops = self.sampling.stop_token_ids  # a turn ends at the run's and the env's ids
            self._turn_stops = stops + tuple(t for t in multi_turn.stop_token_ids if t not in stops)

    def _oldest_allowed(self, step: int) -> int:
        """The oldest version a token of the batch of ``step`` may have (the staleness rule)."""
        return step // self.sync_every - self.max_staleness

    # ------------------------------------------------------------------ trainer API
    def start(self) -> None:
        """Ready the prompt source (after ``load_state_dict`` when resuming); in overlap mode
        start the producer thread."""
        if self._started:
            raise RuntimeError("RolloutQueue.start() was called twice")
        self._started = True
        self._version = (
            int(self._initial_version)
            if self._initial_version is not None
            else int(self.engine.version)
        )
        self._prompt_iter = iter(self.prompts)
        for _ in range(self._groups_taken):  # resume: skip the prompts already taken
            if next(self._prompt_iter, _END) is _END:
                raise PromptsExhausted(
                    f"cannot resume at step {self._next_step}: the prompt source has fewer than "
                    f"{self._groups_taken} prompts"
                )
        self._next_slot = self._next_step + (1 if self._next_step in self._ready else 0)
        if self.mode == "overlap":
            self._thread = threading.Thread(target=self._produce, name="rollout-queue", daemon=True)
            self._thread.start()

    def get_batch(self, step: int, timeout: float | None = None) -> QueueBatch:
        """The batch of training step ``step`` (0-based); steps are requested in order.

        Overlap: blocks until the producer has it (``timeout`` bounds the wait) and re-raises
        any error of the producer thread. Alternate: generates it now, with the weights of
        version ``step // sync_every`` (publish them first), then sleeps the engine. Raises
        PromptsExhausted when the prompts ran out, and RuntimeError if a token violates the
        staleness bound (which the schedules make impossible; it is checked anyway).
        """
        if not self._started:
            raise RuntimeError("call RolloutQueue.start() before get_batch()")
        if step != self._next_step:
            raise ValueError(
                f"get_batch(step={step}) out of order: the next batch is for step "
                f"{self._next_step}; steps are consumed one by one from 0 (or the resumed step)"
            )
        t0 = time.perf_counter()
        if self.mode == "overlap":
            with self._cond:
                self._wait_ready(step, None if timeout is None else t0 + timeout)
                out = self._ready.pop(step)
                tokens, gen_s = self._delivered
                self._delivered = (
                    tokens + int(out.metrics["rollout/tokens"]),
                    gen_s + out.metrics["rollout/gen_time_s"],
                )
        else:
            out = self._generate_now(step)
            self._delivered = (self._tokens_generated, self._gen_time_s)
        with self._cond:
            self._next_step = step + 1
            self._cond.notify_all()
        current = step // self.sync_every
        out.metrics.update(check_staleness(out.batch, self._oldest_allowed(step), current))
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
        """Wake the engine if it sleeps, push the weights of ``version`` and record it. While
        the producer may be generating: with partial rollouts the engine is paused around the
        push (in-flight responses continue under the new weights), without them the push waits
        for the running ``generate`` call to end."""
        if version < self._version:
            raise ValueError(f"version must not decrease: got {version}, have {self._version}")
        t0 = time.perf_counter()
        if self._asleep:
            self.engine.wake()
            self._asleep = False
        self._wake_s = time.perf_counter() - t0
        if self.partial_rollout and self._thread is not None:
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
        run an evaluation that must not share the engine with training rollouts). Alternate
        mode generates only inside ``get_batch``: the engine is idle between two calls."""
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
        """The weight versions that tokens of the next batches may carry: what keep_old_actor
        must keep a snapshot of, besides the latest. Those of the carried tokens within the
        bound (alternate; older ones restart), and every version from the oldest token of the
        ready batches or of the batch in hand (overlap: being generated, scored or collated) to
        the latest."""
        oldest_allowed = self._oldest_allowed(self._next_step)
        with self._cond:
            lows = [
                int(b.batch.versions[b.batch.versions >= 0].min())
                for b in self._ready.values()
                if bool((b.batch.versions >= 0).any())
            ]
            if self._unqueued_version is not None:
                lows.append(self._unqueued_version)
            ahead = set(range(min(lows), self._version + 1)) if lows else set()
            return ahead | {
                v
                for g in self._groups
                for s in g.samples
                if s.done is not None
                for v in s.done.versions
                if v >= max(oldest_allowed, 0)  # -1: observation tokens, not sampled
            }

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/`` counters since start."""
        totals = {
            "rollout/tokens_total": float(self._tokens_generated),
            "rollout/tokens_per_s_total": self._tokens_generated / max(self._gen_time_s, 1e-9),
        }
        if self.multi_turn is not None:
            totals["rollout/env_timeouts_total"] = float(self._env_faults["timeout"])
            totals["rollout/env_errors_total"] = float(self._env_faults["error"])
        if self.mode == "alternate":
            return totals | {"rollout/restarted_total": float(self._restarted_total)}
        return totals | {
            "rollout/capacity_waits": float(self._capacity_waits),
            "rollout/capacity_wait_s": self._capacity_wait_s,
            "rollout/publish_drain_wait_s": self._drain_wait_s,
            "rollout/buffered_batches": float(len(self._ready)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Resume position, the carried groups (their partial tokens included) and the batch
        generated ahead of training.

        Overlap: the next step's batch is (being) generated with weights older than the ones a
        checkpoint saves now, which a resumed run could not rebuild: this waits for that batch
        and saves it (it stays queued here too). A resumed run then trains on the very same
        tokens and its producer continues with the step after it. Before ``start`` nothing is
        ahead. Alternate: nothing is ahead; the carried groups continue in the next step.
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
        taken = (self._next_step + (ahead is not None)) * self.groups_per_batch
        state = {
            "mode": self.mode,
            "sync_every": self.sync_every,
            "samples_per_prompt": self.samples_per_prompt,
            "next_step": self._next_step,
            "groups_taken": taken if self.mode == "overlap" else self._groups_taken,
            "seed": self.seed,
            "carried": list(self._groups),
            "batch_ahead": ahead,
            "tokens_total": tokens,  # the cumulative counters continue on resume
            "gen_time_s": gen_s,
            "restarted_total": self._restarted_total,
        }
        if self.multi_turn is not None:  # carried episodes hold their environment's state
            state["env_faults"] = dict(self._env_faults)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; call before ``start``. A saved state whose settings
        differ from this queue's is refused: versions count publishes (``rollout.sync_every``),
        and carried groups hold ``samples_per_prompt`` samples."""
        if self._started:
            raise RuntimeError("load_state_dict must be called before start()")
        saved_mode = state.get("mode", "overlap")
        if saved_mode != self.mode:
            raise ValueError(
                f"the checkpoint's rollout queue was saved with rollout.mode={saved_mode}; resume "
                f"with the same rollout.mode (this run has {self.mode})"
            )
        for key in ("sync_every", "samples_per_prompt"):
            ours = getattr(self, key)
            saved = state.get(key, ours)  # checkpoints written before the key was saved
            if saved != ours:
                raise ValueError(
                    f"the checkpoint was written with rollout.{key}={saved}, this run has "
                    f"rollout.{key}={ours}: resume with rollout.{key}={saved}"
                )
        ahead = state.get("batch_ahead")
        if "groups_taken" in state:
            self._groups_taken = int(state["groups_taken"])
        else:  # an overlap queue's state of the earlier format
            if state["prompts_consumed"] != state["next_step"] * self.groups_per_batch:
                raise ValueError(
                    f"checkpoint consumed {state['prompts_consumed']} prompts in "
                    f"{state['next_step']} steps, which does not match groups_per_batch="
                    f"{self.groups_per_batch}"
                )
            self._groups_taken = int(state["prompts_consumed"]) + (
                self.groups_per_batch if ahead is not None else 0
            )
        self._next_step = int(state["next_step"])
        self.seed = int(state["seed"])
        self._groups = [_one_turn_episodes(g) for g in state.get("carried", [])]
        self._tokens_generated = int(state.get("tokens_total", 0))
        self._gen_time_s = float(state.get("gen_time_s", 0.0))
        self._restarted_total = int(state.get("restarted_total", 0))
        self._env_faults = dict(state.get("env_faults", self._env_faults))
        self._delivered = (self._tokens_generated, self._gen_time_s)
        self._ready.clear()
        if ahead is not None:  # counted again when it is handed out
            self._delivered = (
                self._tokens_generated - int(ahead.metrics["rollout/tokens"]),
                self._gen_time_s - ahead.metrics["rollout/gen_time_s"],
            )
            self._ready[self._next_step] = ahead

    def close(self) -> None:
        """Stop the producer (aborting its in-flight requests) and join it. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        try:
            self._close_producer()
        finally:
            if self._runner is not None:
                self._runner.close()

    def _close_producer(self) -> None:
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

    # ------------------------------------------------------------------ overlap: the producer
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
                    groups = self._take(self.groups_per_batch)
                    if len(groups) < self.groups_per_batch:
                        self._exhausted_at = slot
                        self._cond.notify_all()
                        return
                    self._generating = True
                    self._unqueued_version = start_version
                t_gen = time.perf_counter()
                tokens_before = self._tokens_generated
                try:  # every turn of the batch's episodes, to their end
                    self._episode_rounds(slot, groups, self._generate, until=None)
                finally:
                    with self._cond:
                        self._generating = False
                        self._cond.notify_all()
                gen_s = time.perf_counter() - t_gen
                if self._stop:
                    return
                generated = self._tokens_generated - tokens_before
                batch = self._assemble(slot, groups, gen_s, generated, start_version)
                with self._cond:
                    self._ready[slot] = batch
                    self._unqueued_version = None
                    self._next_slot = slot + 1
                    self._cond.notify_all()
        except BaseException as e:  # surfaced by get_batch in the trainer's thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    # ------------------------------------------------------------------ alternate: get_batch
    def _generate_now(self, step: int) -> QueueBatch:
        """Restart the carried samples that would break the bound, top the groups in flight up
        to ``in_flight``, stream until ``groups_per_batch`` groups are complete, sleep."""
        current = step // self.sync_every
        if self._version != current:
            raise RuntimeError(
                f"get_batch(step={step}) in alternate mode generates with the weights of version "
                f"{current}: publish them first (the engine holds version {self._version})"
            )
        t0 = time.perf_counter()
        tokens_before = self._tokens_generated
        restarted = self._restart_stale(self._oldest_allowed(step))
        self._groups += self._take(self.in_flight - len(self._groups))
        if len(self._groups) < self.groups_per_batch:
            raise PromptsExhausted(
                f"the prompt source ran out before the batch of step {self._next_step} was filled"
            )
        # rounds of one turn per unfinished episode, until G groups are complete
        self._episode_rounds(step, self._groups, self._stream, until=self.groups_per_batch)
        gen_s = time.perf_counter() - t0
        t_sleep = time.perf_counter()
        if self.sleep:
            self.engine.sleep()
            self._asleep = True
        sleep_s = time.perf_counter() - t_sleep
        done = sorted((g for g in self._groups if g.complete), key=lambda g: g.completed_at)
        if len(done) < self.groups_per_batch:
            raise RuntimeError(
                f"the engine stopped with {len(done)} of {self.groups_per_batch} groups complete"
            )
        batch_groups = sorted(done[: self.groups_per_batch], key=lambda g: g.index)
        taken = {id(g) for g in batch_groups}
        self._groups = [g for g in self._groups if id(g) not in taken]
        generated = self._tokens_generated - tokens_before
        out = self._assemble(step, batch_groups, gen_s, generated, current)
        self._restarted_total += restarted
        out.metrics |= {
            "rollout/carried_over": float(len(self._groups)),
            "rollout/restarted": float(restarted),
            "rollout/groups_in_flight": float(len(self._groups) + len(batch_groups)),
            "perf/rollout_s": gen_s,
            "perf/engine_sleep_s": sleep_s,
            "perf/engine_wake_s": self._wake_s,
        }
        return out

    def _restart_stale(self, oldest_allowed: int) -> int:
        """Drop the tokens of carried samples older than ``oldest_allowed`` (or, without partial
        rollouts, unfinished); they start again from the prompt. Returns how many."""
        count = 0
        for g in self._groups:
            for s in g.samples:
                oldest = s.oldest_version
                stale = oldest is not None and oldest < oldest_allowed
                if stale or (oldest is not None and not s.finished and not self.partial_rollout):
                    s.done, s.reward, s.episode = None, None, None  # an episode: reset again
                    s.attempt += 1
                    g.completed_at = None
                    count += 1
        return count

    # ------------------------------------------------------------------ both schedules
    def _take(self, count: int) -> list[_Group]:
        """Up to ``count`` new groups from the prompt source (fewer when it runs out)."""
        assert self._prompt_iter is not None
        n = self.samples_per_prompt
        groups = []
        for _ in range(max(count, 0)):
            item = next(self._prompt_iter, _END)
            if item is _END:
                break
            index = self._groups_taken
            self._groups_taken += 1
            samples = [_Sample(sample_seed(self.seed, index * n + j)) for j in range(n)]
            groups.append(_Group(index, item, prompt_ids_of(item), samples))
        return groups

    def _generate(
        self, requests: list[GenerateRequest], until_groups: int | None
    ) -> list[Completion]:
        """Overlap: a round runs every request to its end (``until_groups`` is None)."""
        return self.engine.generate(requests)

    def _stream(
        self, requests: list[GenerateRequest], until_groups: int | None
    ) -> Iterator[Completion]:
        """Alternate (and evaluation): completions as they finish, stopped at ``until_groups``."""
        return self.engine.stream(requests, until_groups=until_groups)

    # ------------------------------------------------------------------ episodes
    def _episode_rounds(
        self,
        step: int,
        groups: list[_Group],
        run: Callable[[list[GenerateRequest], int | None], Iterable[Completion]],
        *,
        until: int | None,
    ) -> None:
        """Rounds of one model turn per unfinished episode of ``groups``, until every episode
        ended or (``until``) that many groups are complete.

        ``run(requests, k)`` generates a round; ``k`` (with ``until``) is the number of groups
        still missing, and the engine may stop the round once ``k`` of the groups whose every
        request is a certainly-last turn (``completes_group``) are complete: the other requests
        keep their partial turn, continued by the next round or step. A turn that ended ends a
        one-turn episode at once; an environment answers the round's ended turns after it.
        Groups are numbered in the order they complete."""
        order = itertools.count()

        def number(g: _Group) -> None:
            if g.complete and g.completed_at is None:
                g.completed_at = (step, next(order))

        while True:
            missing = None if until is None else until - sum(g.complete for g in groups)
            if missing is not None and missing <= 0:
                return
            self._start_episodes(groups)
            requests, owners = self._requests(step, groups)
            if not requests or self._stop:
                return
            ended_turns = []
            for c in run(requests, missing):
                group, sample = owners[c.request_id]
                reason = self._merge_turn(group, sample, c)
                if reason is None:
                    continue
                if self.multi_turn is not None:
                    ended_turns.append((group, sample))
                else:  # no environment: the turn was the episode
                    sample.episode.turns += 1
                    sample.episode.truncated = reason == "length"
                    self._end(group, sample, None)
                    number(group)
            if self._stop:
                return
            self._answer_turns(ended_turns)
            for g in groups:
                number(g)

    def _start_episodes(self, groups: list[_Group]) -> None:
        """Start the episode of each sample of ``groups`` without one: ``env.reset(prompt,
        seed)``, concurrently (the sample's seed: a restart resets the same episode)."""
        todo = [(g, s) for g in groups for s in g.samples if s.episode is None]
        if not todo:
            return
        states: list[Any] = [None] * len(todo)  # no environment: no state
        if self.multi_turn is not None:
            assert self._runner is not None
            env = self.multi_turn.env
            states = self._runner.run([_call(env.reset, g.prompt, s.seed) for g, s in todo])
        for (g, s), state in zip(todo, states, strict=True):
            s.episode = _Episode(state=None)
            if isinstance(state, Fault):
                self._fault(g, s, state, "reset")
            else:
                s.episode.state = state

    def _requests(
        self, step: int, groups: list[_Group]
    ) -> tuple[list[GenerateRequest], dict[str, tuple[_Group, _Sample]]]:
        """The request of each unfinished episode's current turn in ``groups`` (from where its
        tokens are); and the (group, sample) of each request id."""
        requests, owners = [], {}
        for g in groups:
            for j, s in enumerate(g.samples):
                if not s.finished:
                    req = self._turn_request(step, g, j, s)
                    requests.append(req)
                    owners[req.request_id] = (g, s)
        return requests, owners

    def _turn_params(self, sample: _Sample) -> SamplingParams:
        """The sampling of the sample's current turn from where its tokens are: the rest of the
        per-turn cap and of the response budget; the run's and the environment's stop ids."""
        assert sample.episode is not None
        n = len(sample.done.token_ids) if sample.done is not None else 0
        in_turn = n - sample.episode.turn_start
        left = self.sampling.max_new_tokens - n
        return replace(
            self.sampling,
            max_new_tokens=min(self._turn_tokens - in_turn, left),
            stop_token_ids=self._turn_stops,
            seed=_continuation_seed(sample.seed, sample.attempt, n),
        )

    def _last_turn(self, sample: _Sample) -> bool:
        """Whether the sample's current turn is certainly its episode's last, so that the
        episode ends when the turn does: it is turn ``max_turns`` (every turn without an
        environment), or one token of the response budget is left."""
        assert sample.episode is not None
        n = len(sample.done.token_ids) if sample.done is not None else 0
        return sample.episode.turns + 1 >= self._max_turns or self.sampling.max_new_tokens - n <= 1

    def _turn_request(self, step: int, group: _Group, j: int, sample: _Sample) -> GenerateRequest:
        """The request that samples (the rest of) the current turn: its prompt is the exact
        context so far, the prompt and every model and observation token (never re-tokenized).
        Only a certainly-last turn may complete its group in an ``until_groups`` count."""
        tokens = sample.done.token_ids if sample.done is not None else []
        rid = f"g{group.index}-n{j}-a{sample.attempt}-s{step}-o{len(tokens)}"
        return GenerateRequest(
            group.prompt_ids + tokens,
            self._turn_params(sample),
            rid,
            str(group.index),
            completes_group=self._last_turn(sample),
        )

    def _merge_turn(self, group: _Group, sample: _Sample, c: Completion) -> str | None:
        """Append a turn's (partial) completion to the episode's tokens. Returns how the turn
        ended ("stop": a stop id, "length": the per-turn cap or the response budget), or None
        when it was stopped mid-turn (continued later)."""
        reason = settled_finish_reason(c.finish_reason, c.token_ids, self._turn_params(sample))
        if reason == "abort" and not c.token_ids:
            return None  # stopped before its first token: nothing changes
        before = self._completion(group, sample)
        sample.done = replace(
            before,
            request_id=c.request_id,
            token_ids=before.token_ids + c.token_ids,
            logprobs=before.logprobs + c.logprobs,
            versions=before.versions + c.versions,
        )
        self._tokens_generated += len(c.token_ids)
        return reason if reason in ("stop", "length") else None

    def _answer_turns(self, ended: list[tuple[_Group, _Sample]]) -> None:
        """``env.step(state, turn)`` for every turn that ended, concurrently; then apply the
        answers in order (deterministic whatever the threads' timing)."""
        if not ended:
            return
        assert self.multi_turn is not None and self._runner is not None
        mt, turns = self.multi_turn, []
        for _, s in ended:
            ep, tokens = s.episode, s.done.token_ids
            ids = list(tokens[ep.turn_start :])
            last = ep.turns + 1 >= self._max_turns or len(tokens) >= self.sampling.max_new_tokens
            reason = "stop" if ids and ids[-1] in self._turn_stops else "length"
            text = self.decode(ids) if self.decode is not None else ""
            turns.append(Turn(ep.turns, ids, text, reason, last))
        calls = [_call(mt.env.step, s.episode.state, t) for (_, s), t in zip(ended, turns)]
        for (g, s), turn, result in zip(ended, turns, self._runner.run(calls), strict=True):
            self._apply_step(g, s, turn, result)

    def _apply_step(self, group: _Group, sample: _Sample, turn: Turn, result: Any) -> None:
        """An observation appended (version -1, logprob 0), cut to the response budget; or the
        end of the episode."""
        assert self.multi_turn is not None and sample.episode is not None
        mt, ep = self.multi_turn, sample.episode
        what = f"step (turn {turn.index})"
        if isinstance(result, Fault):
            return self._fault(group, sample, result, what)
        if not isinstance(result, StepResult):
            kind = type(result).__name__
            fault = Fault("error", f"returned a {kind}, expected a minippo.env.StepResult")
            return self._fault(group, sample, fault, what)
        if result.state is not None:
            ep.state = result.state
        ep.turns += 1
        obs = result.observation
        if obs is None or turn.last:
            ep.truncated = obs is not None  # no turn may follow: the observation is dropped
            return self._end(group, sample, result.reward)
        if isinstance(obs, str):
            try:
                ids = mt.encode_observation(obs, turn.token_ids[-1] if turn.token_ids else None)
            except Exception as e:
                fault = Fault("error", f"observation {obs[:40]!r} cannot be encoded ({e})")
                return self._fault(group, sample, fault, what)
        else:
            ids = list(obs)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < mt.vocab_size]
            if bad:
                fault = Fault(
                    "error",
                    f"returned observation ids {bad[:5]} outside the vocabulary "
                    f"[0, {mt.vocab_size})",
                )
                return self._fault(group, sample, fault, what)
        room = self.sampling.max_new_tokens - len(sample.done.token_ids)
        ended = len(ids) >= room  # no room for another model turn after it
        if len(ids) > room:
            ep.obs_cut, ids = True, ids[:room]
        sample.done = replace(
            sample.done,
            token_ids=sample.done.token_ids + ids,
            logprobs=sample.done.logprobs + [0.0] * len(ids),
            versions=sample.done.versions + [-1] * len(ids),  # not sampled by the policy
        )
        ep.obs_tokens += len(ids)
        ep.turn_start = len(sample.done.token_ids)
        if ended:
            ep.truncated = True
            self._end(group, sample, result.reward)

    def _fault(self, group: _Group, sample: _Sample, fault: Fault, what: str) -> None:
        """An environment call that raised, hung or answered something unusable: one line
        (on_error=raise), or the episode ends with reward 0, counted (on_error=zero_reward)."""
        assert self.multi_turn is not None and sample.episode is not None
        mt = self.multi_turn
        if mt.on_error == "raise":
            where = _describe_prompt(self._as_sample(group, sample))
            fix = (
                "raise multi_turn.step_timeout_s"
                if fault.kind == "timeout"
                else "fix the environment"
            )
            raise EnvError(
                f"environment {mt.name} {what} {fault.message} for {where}; {fix}, or set "
                "multi_turn.on_error=zero_reward to end such episodes with reward 0"
            )
        self._env_faults[fault.kind] += 1
        sample.episode.fault = fault.kind
        self._end(group, sample, 0.0)

    def _end(self, group: _Group, sample: _Sample, reward: float | None) -> None:
        """End the episode, with the environment's reward (None: the reward function's);
        ``_score`` scores it where its batch is assembled."""
        assert sample.episode is not None
        ep = sample.episode
        ep.ended, ep.reward = True, reward
        finish = "length" if ep.truncated else "stop"
        sample.done = replace(self._completion(group, sample), finish_reason=finish)

    def _score(self, groups: list[_Group]) -> None:
        """Score the ended episodes of ``groups`` not scored yet, in order: the environment's
        reward, else the reward function (without either, a single-turn sample's reward is left
        to the trainer). Outside the rounds: in overlap a publish never waits for a reward."""
        for g in groups:
            for s in g.samples:
                if not s.finished or s.reward is not None:
                    continue
                reward = s.episode.reward
                if reward is not None:
                    assert self.multi_turn is not None
                    name = f"environment {self.multi_turn.name}"
                    s.reward = score_sample(lambda _, r=reward: r, name, self._as_sample(g, s))
                elif self.reward_fn is not None:
                    s.reward = score_sample(self.reward_fn, self.reward_name, self._as_sample(g, s))
                elif self.multi_turn is not None:
                    raise ValueError(
                        f"environment {self.multi_turn.name} ended an episode without a reward "
                        "and the queue has no reward_fn; return StepResult(reward=...) or pass a "
                        "reward_fn"
                    )

    def _completion(self, group: _Group, sample: _Sample) -> Completion:
        """The sample's tokens so far: an empty completion before the first."""
        if sample.done is not None:
            return sample.done
        j = group.samples.index(sample)
        return Completion(f"g{group.index}-n{j}", list(group.prompt_ids), [], [], [], "abort")

    def _as_sample(self, group: _Group, sample: _Sample) -> RolloutSample:
        j = group.samples.index(sample)
        completion = self._completion(group, sample)
        return RolloutSample(
            prompt=group.prompt,
            prompt_ids=list(group.prompt_ids),
            completion=completion,
            text=self.decode(completion.token_ids) if self.decode is not None else None,
            reward=sample.reward,
            group=-1,  # its row's group is set when the batch is assembled
            sample_index=group.index * self.samples_per_prompt + j,
            turns=sample.episode.turns if sample.episode is not None else 1,
        )

    def _assemble(
        self, step: int, groups: list[_Group], gen_s: float, generated: int, start_version: int
    ) -> QueueBatch:
        self._score(groups)
        samples, owners = [], []
        for gi, g in enumerate(groups):
            for s in g.samples:
                sample = self._as_sample(g, s)
                sample.group = gi
                samples.append(sample)
                owners.append(gi)
        completions = [s.completion for s in samples]
        scored = self.reward_fn is not None or self.multi_turn is not None
        rewards = [s.reward for s in samples] if scored else None
        batch = collate_completions(completions, owners, rewards, pad_id=self.pad_id)
        self._gen_time_s += gen_s
        metrics = batch_metrics(batch, gen_s, has_rewards=rewards is not None, generated=generated)
        metrics["rollout/start_version"] = float(start_version)
        if self.multi_turn is not None:
            metrics |= episode_metrics([s.episode for g in groups for s in g.samples])
        return QueueBatch(step=step, batch=batch, samples=samples, metrics=metrics)


def run_episodes(
    engine: RolloutEngine,
    items: list[tuple[int, Any]],
    *,
    samples_per_prompt: int,
    sampling: SamplingParams,
    multi_turn: MultiTurn,
    seed: int = 0,
    reward_fn: Callable[[RolloutSample], float] | None = None,
    reward_name: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> list[RolloutSample]:
    """Run ``samples_per_prompt`` episodes of each ``(position, prompt item)`` to their end with
    the engine's current weights, exactly as the queue runs them (evaluation); the samples in
    item order, sample ``j`` of position ``i`` seeded ``sample_seed(seed, i * n + j)``."""
    n = samples_per_prompt
    queue = RolloutQueue(
        engine, [], groups_per_batch=max(len(items), 1), samples_per_prompt=n,
        sampling=sampling, mode="alternate", sleep=False, reward_fn=reward_fn,
        reward_name=reward_name, decode=decode, seed=seed, multi_turn=multi_turn,
    )  # fmt: skip
    groups = [
        _Group(
            i, item, prompt_ids_of(item), [_Sample(sample_seed(seed, i * n + j)) for j in range(n)]
        )
        for i, item in items
    ]
    try:
        queue._episode_rounds(0, groups, queue._stream, until=None)
        queue._score(groups)
    finally:
        queue.close()
    return [queue._as_sample(g, s) for g in groups for s in g.samples]


def episode_metrics(episodes: list[Any]) -> dict[str, float]:
    """``rollout/`` statistics of a batch's multi-turn episodes: model turns and observation
    tokens per sample, environment faults, truncations."""
    n = max(len(episodes), 1)
    return {
        "rollout/turns_mean": sum(e.turns for e in episodes) / n,
        "rollout/obs_tokens_mean": sum(e.obs_tokens for e in episodes) / n,
        "rollout/env_timeouts": float(sum(e.fault == "timeout" for e in episodes)),
        "rollout/env_errors": float(sum(e.fault == "error" for e in episodes)),
        "rollout/obs_truncated": float(sum(e.obs_cut for e in episodes)),
        "rollout/episodes_truncated": float(sum(e.truncated for e in episodes)),
    }


def _one_turn_episodes(group: _Group) -> _Group:
    """A carried group as this queue holds it. A state saved before single-turn samples were
    one-turn episodes holds samples with tokens and no episode: each gets its one-turn episode
    (ended when the sample had finished), so that it continues, or is trained, as it was."""
    for s in group.samples:
        vars(s).pop("multi_turn", None)  # a field of that format
        if s.episode is None and s.done is not None:
            reason = s.done.finish_reason
            ended = reason in ("stop", "length")
            s.episode = _Episode(None, turns=int(ended), ended=ended, truncated=reason == "length")
    return group


def _call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


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
        r = batch.rewards.double()
        _, group = torch.unique(batch.group_ids, return_inverse=True)
        n_groups = int(group.max()) + 1 if r.numel() else 0
        hi = torch.full((n_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amax")
        lo = torch.full((n_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amin")
        metrics["rollout/reward_mean"] = float(r.mean())
        metrics["rollout/reward_std"] = float(r.std(correction=0))
        # groups whose samples all scored the same: no signal for GRPO, little for a critic
        metrics["rollout/zero_variance_groups"] = float((hi == lo).double().mean())
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
    index = index if isinstance(index, int) else None  # (a list's .index is a method)
    text = getattr(item, "prompt", None)
    text = text if isinstance(text, str) else None
    head = f"prompt {index}" if index is not None else f"sample {sample.sample_index}"
    if text is not None:
        short = text if len(text) <= 60 else text[:57] + "..."
        head += f" ({short!r})"
    return f"{head}, completion {(sample.text or '')[:60]!r}"


def _continuation_seed(seed: int, attempt: int, offset: int) -> int:
    """The seed of a request that samples token ``offset`` onwards of a sample (attempt 0 from
    the prompt keeps the sample's own seed, :func:`sample_seed`)."""
    if attempt == 0 and offset == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{attempt}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


_END = object()
