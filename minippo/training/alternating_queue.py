"""Rollouts for a GPU shared by the engine and the trainer: generate, sleep, train, in turn.

``rollout.mode: alternate``. Nothing generates while the trainer trains; one step is::

    publish(version s)   wake the engine, push the weights of version s
    get_batch(s)         continue the carried groups, start new ones, stream completions until
                         ``groups_per_batch`` groups are complete, stop the rest, sleep the engine
    ...train...          the engine holds no accelerator memory meanwhile

Asynchrony comes from partial rollouts. The engine holds up to ``ceil(groups_per_batch ×
oversample)`` groups in flight (a group: the ``samples_per_prompt`` samples of one prompt). A
batch takes the first ``groups_per_batch`` groups to complete; its rows are ordered by the groups'
submission. The others are stopped where they are and carried into the next step: their tokens
are kept and they continue, under the next weights, as new requests whose prompt is the old one
plus the tokens so far. So a trained sample may span several versions, each token stamped with
its own (the corrections handle exactly this). With TorchEngine, whose stops are exact and whose
requests are seeded, a run is reproducible and resumes exactly.

Staleness stays bounded: the batch of step ``s`` only holds tokens with ``v >= s −
max_staleness``. A carried sample whose oldest token would break that bound is restarted from its
prompt (``rollout/restarted``), finished or not. With ``partial_rollout: false`` every unfinished
carried sample restarts (no sample spans two versions; the work already done is dropped).

The trainer-facing interface is :class:`~minippo.training.rollout_queue.RolloutQueue`'s:
``start``, ``get_batch``, ``publish``, ``referenced_versions``, ``state_dict`` /
``load_state_dict``, ``close``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from minippo.engine.protocol import (
    Completion,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightBucket,
    settled_finish_reason,
)
from minippo.training.rollout_queue import (
    PromptsExhausted,
    QueueBatch,
    QueueSettings,
    RolloutSample,
    batch_metrics,
    check_staleness,
    collate_completions,
    prompt_ids_of,
    sample_seed,
    score_sample,
)


@dataclass
class _Sample:
    """One sample of a group: nothing yet, a partial completion, or a finished one."""

    seed: int
    done: Completion | None = None  # the tokens so far (finish_reason "abort" while partial)
    reward: float | None = None
    attempt: int = 0  # restarts from the prompt

    @property
    def finished(self) -> bool:
        return self.done is not None and self.done.finish_reason in ("stop", "length")

    @property
    def oldest_version(self) -> int | None:
        return min(self.done.versions) if self.done is not None and self.done.versions else None


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


class AlternatingQueue(QueueSettings):
    """Generation between training steps, with over-provisioned streaming groups.

    Args: those of :class:`~minippo.training.rollout_queue.RolloutQueue` (``engine``,
    ``prompts``, ``groups_per_batch``, ``samples_per_prompt``, ``sampling``, ``max_staleness``,
    ``partial_rollout``, ``reward_fn``, ``reward_name``, ``decode``, ``pad_id``, ``seed``,
    ``initial_version``) and:
        oversample: groups in flight per step = ``ceil(groups_per_batch × oversample)`` (>= 1).
        sleep:      put the engine to sleep after each batch and wake it before each publish
                    (True for a GPU shared with the trainer; the tests may turn it off).
    """

    MODE = "alternate"

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
        partial_rollout: bool = True,
        oversample: float = 1.0,
        sleep: bool = True,
        reward_fn: Callable[[RolloutSample], float] | None = None,
        reward_name: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
        pad_id: int = 0,
        seed: int = 0,
        initial_version: int | None = None,
    ) -> None:
        if not (isinstance(oversample, int | float) and math.isfinite(oversample)) or (
            oversample < 1
        ):
            raise ValueError(f"rollout.oversample must be a number >= 1.0, got {oversample!r}")
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
        self.in_flight = math.ceil(groups_per_batch * oversample - 1e-9)
        self.sleep = bool(sleep)
        self._version = 0
        self._next_step = 0
        self._groups_taken = 0  # prompts taken from the source since the start of training
        self._groups: list[_Group] = []  # carried into the next step, in submission order
        self._prompt_iter: Iterator[Any] | None = None
        self._started = False
        self._asleep = False
        self._wake_s = 0.0  # of the last publish, reported with the next batch
        self._tokens_generated = 0
        self._gen_time_s = 0.0
        self._restarted_total = 0

    # ------------------------------------------------------------------ trainer API
    def start(self) -> None:
        """Ready the prompt source (after ``load_state_dict`` when resuming)."""
        if self._started:
            raise RuntimeError("AlternatingQueue.start() was called twice")
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

    def publish(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Wake the engine (if it sleeps) and push the weights of ``version``."""
        if version < self._version:
            raise ValueError(f"version must not decrease: got {version}, have {self._version}")
        t0 = time.perf_counter()
        if self._asleep:
            self.engine.wake()
            self._asleep = False
        self._wake_s = time.perf_counter() - t0
        self.engine.publish_weights(buckets, version)
        self._version = int(version)

    def on_weights_published(self, version: int) -> None:
        """Record that the engine now holds ``version`` (when weights were pushed elsewhere)."""
        if version < self._version:
            raise ValueError(f"version must not decrease: got {version}, have {self._version}")
        self._version = int(version)

    def get_batch(self, step: int) -> QueueBatch:
        """Generate the batch of ``step`` now (the engine holds version ``step``), then sleep."""
        if not self._started:
            raise RuntimeError("call AlternatingQueue.start() before get_batch()")
        if step != self._next_step:
            raise ValueError(
                f"get_batch(step={step}) out of order: the next batch is for step "
                f"{self._next_step}; steps are consumed one by one from 0 (or the resumed step)"
            )
        current = step // self.sync_every
        if self._version != current:
            raise RuntimeError(
                f"get_batch(step={step}) in alternate mode generates with the weights of version "
                f"{current}: publish them first (the engine holds version {self._version})"
            )
        t0 = time.perf_counter()
        tokens_before = self._tokens_generated
        restarted = self._restart_stale(self._oldest_allowed(step))
        self._fill()
        ready = [g for g in self._groups if g.complete]
        need = self.groups_per_batch - len(ready)
        requests, owners = self._requests(step)
        order = 0
        if need > 0:
            for c in self.engine.stream(requests, until_groups=need):
                group, sample = owners[c.request_id]
                self._merge(group, sample, c)
                if group.complete and group.completed_at is None:
                    group.completed_at = (step, order)
                    order += 1
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
        out = self._assemble(step, batch_groups, gen_s, self._tokens_generated - tokens_before)
        out.metrics.update(check_staleness(out.batch, self._oldest_allowed(step), current))
        self._next_step = step + 1
        self._restarted_total += restarted
        out.metrics |= {
            "rollout/carried_over": float(len(self._groups)),
            "rollout/restarted": float(restarted),
            "rollout/restarted_total": float(self._restarted_total),
            "rollout/groups_in_flight": float(len(self._groups) + len(batch_groups)),
            "perf/rollout_s": gen_s,
            "perf/engine_sleep_s": sleep_s,
            "perf/engine_wake_s": self._wake_s,
            "rollout/wait_s": time.perf_counter() - t0,
            **self.metrics(),
        }
        return out

    @contextmanager
    def engine_idle(self) -> Iterator[None]:
        """The engine runs nothing of the queue's between two ``get_batch`` calls: a no-op (the
        ``RolloutQueue`` interface). After a ``publish`` the engine is awake."""
        yield

    def referenced_versions(self) -> set[int]:
        """The weight versions of the carried tokens that the next batch may still train on
        (what keep_old_actor must keep a snapshot of, besides the latest); older ones restart."""
        oldest_allowed = self._oldest_allowed(self._next_step)
        return {
            v
            for g in self._groups
            for s in g.samples
            if s.done is not None
            for v in s.done.versions
            if v >= oldest_allowed
        }

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/`` counters since start."""
        return {
            "rollout/tokens_total": float(self._tokens_generated),
            "rollout/tokens_per_s_total": self._tokens_generated / max(self._gen_time_s, 1e-9),
        }

    def state_dict(self) -> dict[str, Any]:
        """Resume position and the carried groups (their partial tokens included)."""
        return {
            **self._settings_state(),
            "next_step": self._next_step,
            "groups_taken": self._groups_taken,
            "seed": self.seed,
            "carried": list(self._groups),
            "tokens_total": self._tokens_generated,
            "gen_time_s": self._gen_time_s,
            "restarted_total": self._restarted_total,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; call before ``start``."""
        if self._started:
            raise RuntimeError("load_state_dict must be called before start()")
        self._check_settings(state)
        self._next_step = int(state["next_step"])
        self._groups_taken = int(state["groups_taken"])
        self.seed = int(state["seed"])
        self._groups = list(state["carried"])
        self._tokens_generated = int(state["tokens_total"])
        self._gen_time_s = float(state["gen_time_s"])
        self._restarted_total = int(state["restarted_total"])

    def close(self) -> None:
        """Nothing runs in the background: closing only ends the use of the engine."""

    def __enter__(self) -> AlternatingQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _restart_stale(self, oldest_allowed: int) -> int:
        """Drop the tokens of carried samples older than ``oldest_allowed`` (or, without partial
        rollouts, unfinished); they start again from the prompt. Returns how many."""
        count = 0
        for g in self._groups:
            for s in g.samples:
                oldest = s.oldest_version
                stale = oldest is not None and oldest < oldest_allowed
                if stale or (oldest is not None and not s.finished and not self.partial_rollout):
                    s.done, s.reward = None, None
                    s.attempt += 1
                    g.completed_at = None
                    count += 1
        return count

    def _fill(self) -> None:
        """Take new prompts until ``in_flight`` groups are held (PromptsExhausted if the source
        cannot even complete a batch)."""
        assert self._prompt_iter is not None
        n = self.samples_per_prompt
        while len(self._groups) < self.in_flight:
            item = next(self._prompt_iter, _END)
            if item is _END:
                if len(self._groups) < self.groups_per_batch:
                    raise PromptsExhausted(
                        f"the prompt source ran out before the batch of step {self._next_step} "
                        "was filled"
                    )
                return
            index = self._groups_taken
            self._groups_taken += 1
            seeds = [
                sample_seed(self.seed, index * n + j) for j in range(n)
            ]  # the overlap queue's per-sample seeds
            self._groups.append(
                _Group(index, item, prompt_ids_of(item), [_Sample(seed) for seed in seeds])
            )

    def _requests(
        self, step: int
    ) -> tuple[list[GenerateRequest], dict[str, tuple[_Group, _Sample]]]:
        """One request per unfinished sample: from the prompt, or continuing its tokens."""
        requests, owners = [], {}
        for g in self._groups:
            for j, s in enumerate(g.samples):
                if s.finished:
                    continue
                tokens = s.done.token_ids if s.done is not None else []
                params = replace(
                    self.sampling,
                    max_new_tokens=self.sampling.max_new_tokens - len(tokens),
                    seed=_continuation_seed(s.seed, s.attempt, len(tokens)),
                )
                rid = f"g{g.index}-n{j}-a{s.attempt}-s{step}"  # group, sample, restarts, step
                requests.append(GenerateRequest(g.prompt_ids + tokens, params, rid, str(g.index)))
                owners[rid] = (g, s)
        return requests, owners

    def _merge(self, group: _Group, sample: _Sample, c: Completion) -> None:
        """Append a completion's tokens to the sample's; score it once it is finished."""
        before = sample.done
        if c.finish_reason == "abort" and not c.token_ids:
            return  # stopped before its first token: nothing changes
        tokens = (before.token_ids if before else []) + c.token_ids
        sample.done = Completion(
            request_id=c.request_id,
            prompt_ids=list(group.prompt_ids),
            token_ids=tokens,
            logprobs=(before.logprobs if before else []) + c.logprobs,
            versions=(before.versions if before else []) + c.versions,
            # an abort in the step that finished the sample (its last token a stop id, or no
            # budget left) is a finished sample: never continued past its end
            finish_reason=settled_finish_reason(c.finish_reason, tokens, self.sampling),
        )
        n_new = len(c.token_ids)
        self._tokens_generated += n_new
        if sample.finished and self.reward_fn is not None:
            sample.reward = score_sample(
                self.reward_fn, self.reward_name, self._as_sample(group, sample)
            )

    def _as_sample(self, group: _Group, sample: _Sample) -> RolloutSample:
        assert sample.done is not None
        j = group.samples.index(sample)
        return RolloutSample(
            prompt=group.prompt,
            prompt_ids=list(group.prompt_ids),
            completion=sample.done,
            text=self.decode(sample.done.token_ids) if self.decode is not None else None,
            reward=sample.reward,
            group=-1,  # its row's group is set when the batch is assembled
            sample_index=group.index * self.samples_per_prompt + j,
        )

    def _assemble(
        self, step: int, groups: list[_Group], gen_s: float, generated: int
    ) -> QueueBatch:
        samples, owners = [], []
        for gi, g in enumerate(groups):
            for s in g.samples:
                sample = self._as_sample(g, s)
                sample.group = gi
                samples.append(sample)
                owners.append(gi)
        completions = [s.completion for s in samples]
        rewards = [s.reward for s in samples] if self.reward_fn is not None else None
        batch = collate_completions(completions, owners, rewards, pad_id=self.pad_id)
        self._gen_time_s += gen_s
        metrics = batch_metrics(batch, gen_s, has_rewards=rewards is not None, generated=generated)
        metrics["rollout/start_version"] = float(step // self.sync_every)
        return QueueBatch(step=step, batch=batch, samples=samples, metrics=metrics)


def _continuation_seed(seed: int, attempt: int, offset: int) -> int:
    """The seed of a request that samples token ``offset`` onwards of a sample (attempt 0 from
    the prompt keeps the sample's own seed, as the overlap queue uses it)."""
    if attempt == 0 and offset == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{attempt}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


_END = object()
