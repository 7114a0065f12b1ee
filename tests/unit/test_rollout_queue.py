"""RolloutQueue: staleness bound, synchronous mode, partial rollouts, resume, batch layout.

Most tests drive the queue with ``FakeEngine`` (a protocol implementation whose tokens are cheap
and whose decode steps take random time), the last ones with a real TorchEngine on a tiny model.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from minippo.engine import Completion, GenerateRequest, SamplingParams, validate_requests
from minippo.training.rollout_queue import (
    PromptsExhausted,
    RolloutQueue,
    collate_completions,
    prompt_ids_of,
)


class FakeEngine:
    """RolloutEngine whose token t of a request is (seed + t) % 50 + 1, one token per step.

    Every step sleeps a random time (``step_s`` * U(0, 2)); pause/resume/publish/abort follow the
    protocol, and each token is stamped with the version current at its step.
    """

    def __init__(self, step_s: float = 0.001, seed: int = 0) -> None:
        self._version = 0
        self._cond = threading.Condition()
        self._paused = False
        self._abort = False
        self._rng = random.Random(seed)
        self.step_s = step_s
        self.generate_calls = 0
        self.progress = 0  # decode steps done in the latest generate call
        self.publishes: list[int] = []

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests):
        validate_requests(requests, max_seq_len=4096)
        self.generate_calls += 1
        self.progress = 0
        outs = [([], [], []) for _ in requests]
        done = [None] * len(requests)
        while any(d is None for d in done):
            with self._cond:
                while self._paused and not self._abort:
                    self._cond.wait()
                if self._abort:
                    done = [d or "abort" for d in done]
                    break
                for i, r in enumerate(requests):
                    if done[i] is not None:
                        continue
                    toks, lps, vs = outs[i]
                    tok = (r.params.seed + len(toks)) % 50 + 1
                    toks.append(tok)
                    lps.append(-float(tok) / 100)
                    vs.append(self._version)
                    if tok in r.params.stop_token_ids:
                        done[i] = "stop"
                    elif len(toks) >= r.params.max_new_tokens:
                        done[i] = "length"
                self.progress += 1
            time.sleep(self.step_s * 2 * self._rng.random())
        with self._cond:
            self._abort = False
        return [
            Completion(r.request_id, list(r.prompt_ids), t, lp, v, d)
            for r, (t, lp, v), d in zip(requests, outs, done)
        ]

    def publish_weights(self, buckets, version):
        with self._cond:
            for _ in buckets:
                pass
            self._version = version
            self.publishes.append(version)

    def pause(self):
        with self._cond:
            self._paused = True

    def resume(self):
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(self):
        with self._cond:
            self._abort = True
            self._cond.notify_all()
        return []

    def sleep(self):
        pass

    def wake(self):
        pass

    def shutdown(self):
        pass


def wait_until_generating(eng: FakeEngine, call: int, steps: int = 3) -> None:
    """Block until the engine's ``call``-th generate call has done ``steps`` decode steps."""
    deadline = time.time() + 30
    while not (eng.generate_calls == call and eng.progress >= steps):
        assert time.time() < deadline, "the engine never started the expected generate call"
        time.sleep(0.001)


def prompts(n: int):
    return [{"prompt_ids": [1 + i % 7, 2, 3][: 1 + i % 3], "answer": i} for i in range(n)]


def run_loop(queue: RolloutQueue, steps: int, train_s: float = 0.0, rng=None):
    """The recipe's loop: get batch, 'train', publish version step + 1."""
    out = []
    queue.start()
    for step in range(steps):
        qb = queue.get_batch(step, timeout=30)
        out.append(qb)
        if train_s:
            time.sleep(train_s * (2 * rng.random() if rng else 1.0))
        queue.publish([[("w", torch.zeros(1))]], version=step + 1)
    queue.close()
    return out


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("partial", [False, True])
def test_staleness_bound_holds_under_random_timing(max_staleness, partial):
    rng = random.Random(max_staleness * 10 + partial)
    for trial in range(3):
        eng = FakeEngine(step_s=0.0005 * (trial + 1), seed=trial)
        q = RolloutQueue(
            eng,
            prompts(40),
            groups_per_batch=2,
            samples_per_prompt=2,
            sampling=SamplingParams(max_new_tokens=rng.randint(3, 30), stop_token_ids=(7,)),
            max_staleness=max_staleness,
            partial_rollout=partial,
        )
        batches = run_loop(q, 8, train_s=0.003, rng=rng)
        for step, qb in enumerate(batches):
            v = qb.batch.versions[qb.batch.versions >= 0]
            assert int(v.min()) >= step - max_staleness, (step, v.tolist())
            assert int(v.max()) <= step
            assert qb.metrics["rollout/staleness_max"] <= max_staleness
            assert qb.metrics["rollout/staleness_min"] >= 0
            if not partial:  # without partial rollouts no response spans two versions
                for s in qb.samples:
                    assert len(set(s.completion.versions)) == 1


def test_max_staleness_zero_is_the_synchronous_loop():
    """Batch s is generated only after version s is published, entirely by version s."""
    eng = FakeEngine()
    q = RolloutQueue(
        eng,
        prompts(30),
        groups_per_batch=3,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=6),
        max_staleness=0,
    )
    q.start()
    for step in range(5):
        qb = q.get_batch(step, timeout=30)
        assert set(qb.batch.versions[qb.batch.versions >= 0].tolist()) == {step}
        assert qb.metrics["rollout/start_version"] == step
        assert qb.metrics["rollout/staleness_max"] == 0
        time.sleep(0.01)  # "train"
        # no batch generated ahead: batch step + 1 needs version step + 1, not published yet
        assert eng.generate_calls == step + 1
        q.publish([[("w", torch.zeros(1))]], version=step + 1)
    q.close()


def test_async_generates_ahead_and_counts_capacity_waits():
    eng = FakeEngine()
    q = RolloutQueue(
        eng,
        prompts(30),
        groups_per_batch=2,
        samples_per_prompt=1,
        sampling=SamplingParams(max_new_tokens=3),
        max_staleness=2,
    )
    q.start()
    deadline = time.time() + 10
    while q.metrics()["rollout/buffered_batches"] < 3 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    # batches 0, 1, 2 may start under version 0; batch 3 must wait for version 1
    assert q.metrics()["rollout/buffered_batches"] == 3
    assert eng.generate_calls == 3
    qb = q.get_batch(0)
    assert qb.metrics["rollout/capacity_waits"] >= 1
    q.publish([], version=1)
    qb1 = q.get_batch(1, timeout=10)
    assert qb1.metrics["rollout/staleness_max"] == 1  # generated under v0, consumed at step 1
    q.close()


def test_a_batch_being_scored_keeps_its_version_referenced():
    """Between the engine's return and the batch's arrival in the ready set (rewards scored,
    rows collated) the batch's version is still referenced: a publish in that window must not
    let keep_old_actor evict the snapshot its tokens need (a run at max_staleness 4 once failed
    at step 2 with "no anchor from a snapshot of their own version")."""
    eng = FakeEngine()
    scoring, release = threading.Event(), threading.Event()

    def slow_reward(sample):
        scoring.set()
        assert release.wait(timeout=30)
        return 0.0

    q = RolloutQueue(
        eng,
        prompts(8),
        groups_per_batch=2,
        samples_per_prompt=1,
        sampling=SamplingParams(max_new_tokens=3),
        reward_fn=slow_reward,
        max_staleness=4,
    )
    q.start()
    try:
        assert scoring.wait(timeout=30)  # batch 0 generated under version 0, now being scored
        q.publish([], version=1)
        q.publish([], version=2)
        assert 0 in q.referenced_versions()
        release.set()
        qb = q.get_batch(0, timeout=30)
        assert qb.batch.versions[qb.batch.versions >= 0].unique().tolist() == [0]
    finally:
        release.set()
        q.close()


def test_partial_rollout_keeps_per_token_versions():
    """A publish during a long generation splits responses into old-version | new-version runs."""
    eng = FakeEngine(step_s=0.0005)
    q = RolloutQueue(
        eng,
        prompts(10),
        groups_per_batch=1,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=1000),
        max_staleness=1,
        partial_rollout=True,
    )
    q.start()
    b0 = q.get_batch(0, timeout=30)
    wait_until_generating(eng, call=2)  # batch 1 is now being generated under version 0
    q.publish([], version=1)
    b1 = q.get_batch(1, timeout=30)
    q.close()
    assert set(b0.batch.versions[b0.batch.versions >= 0].tolist()) == {0}
    for s in b1.samples:
        v = s.completion.versions
        assert v == sorted(v) and set(v) == {0, 1}, v  # spans both, old first
    assert b1.metrics["rollout/multi_version_fraction"] == 1.0
    # the per-token versions land in the batch tensor at the right positions
    for row, s in enumerate(b1.samples):
        n = len(s.completion.versions)
        assert b1.batch.versions[row, :n].tolist() == s.completion.versions


def test_publish_without_partial_rollout_waits_for_running_generation():
    eng = FakeEngine(step_s=0.002)
    q = RolloutQueue(
        eng,
        prompts(10),
        groups_per_batch=1,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=100),
        max_staleness=1,
        partial_rollout=False,
    )
    q.start()
    q.get_batch(0, timeout=30)
    wait_until_generating(eng, call=2)
    q.publish([], version=1)
    b1 = q.get_batch(1, timeout=30)
    q.close()
    for s in b1.samples:
        assert set(s.completion.versions) == {0}
    assert b1.metrics["rollout/publish_drain_wait_s"] > 0


def test_batch_layout_rewards_and_metadata():
    eng = FakeEngine()
    seen = []

    def reward_fn(sample):
        seen.append(sample.prompt["answer"])
        return float(sample.completion.token_ids[0] == sample.prompt["answer"] % 50 + 1)

    q = RolloutQueue(
        eng,
        prompts(12),
        groups_per_batch=3,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=5, stop_token_ids=(4,)),
        reward_fn=reward_fn,
        decode=lambda ids: " ".join(map(str, ids)),
        pad_id=0,
    )
    (qb,) = run_loop(q, 1)
    b = qb.batch
    assert b.batch_size == 6 and b.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert [s.prompt["answer"] for s in qb.samples] == [0, 0, 1, 1, 2, 2]
    assert seen == [0, 0, 1, 1, 2, 2]
    P = b.prompt_len
    for row, s in enumerate(qb.samples):
        c = s.completion
        lp, lr = len(c.prompt_ids), len(c.token_ids)
        assert b.input_ids[row, P - lp : P].tolist() == c.prompt_ids
        assert b.input_ids[row, P : P + lr].tolist() == c.token_ids
        assert (
            not b.attention_mask[row, : P - lp].any()
            and b.attention_mask[row, P - lp : P + lr].all()
        )
        assert not b.attention_mask[row, P + lr :].any()
        assert b.position_ids[row, P - lp : P + lr].tolist() == list(range(lp + lr))
        assert b.response_mask[row].sum() == lr
        assert torch.allclose(b.rollout_logprobs[row, :lr], torch.tensor(c.logprobs))
        assert (b.versions[row, lr:] == -1).all()
        assert bool(b.truncated[row]) == (c.finish_reason == "length")
        assert s.text == " ".join(map(str, c.token_ids))
        assert b.rewards[row] == s.reward
    # different samples of one prompt get different seeds
    assert qb.samples[0].completion.token_ids != qb.samples[1].completion.token_ids


def test_resume_reproduces_the_uninterrupted_sequence():
    def make(version=0):
        eng = FakeEngine()
        eng._version = version  # a resumed engine is built from the checkpoint's weights
        return RolloutQueue(
            eng,
            prompts(30),
            groups_per_batch=2,
            samples_per_prompt=2,
            sampling=SamplingParams(max_new_tokens=4),
            max_staleness=1,
            seed=5,
        )

    full = run_loop(make(), 5)
    q = make()
    q.start()
    for step in range(2):
        q.get_batch(step, timeout=10)
        q.publish([], version=step + 1)
    state = q.state_dict()  # waits for the batch of step 2 and saves it (generated ahead)
    q.close()
    ahead = state.pop("batch_ahead")
    tokens = state.pop("tokens_total")  # the cumulative counters continue after a resume
    assert tokens == sum(int(full[s].batch.response_mask.sum()) for s in range(3))
    assert state.pop("gen_time_s") > 0
    settings = {"mode": "overlap", "sync_every": 1, "samples_per_prompt": 2}
    # the prompts of steps 0-2 are taken (step 2's batch is ahead); nothing is carried
    position = {"next_step": 2, "groups_taken": 6, "seed": 5, "carried": [], "restarted_total": 0}
    assert state == {**settings, **position}
    assert ahead.step == 2 and torch.equal(ahead.batch.input_ids, full[2].batch.input_ids)
    state["batch_ahead"] = ahead
    state["tokens_total"] = tokens
    q2 = make(version=2)
    q2.load_state_dict(state)
    assert q2.metrics()["rollout/tokens_total"] == tokens
    q2.start()
    for step in (2, 3, 4):
        qb = q2.get_batch(step, timeout=10)
        ref = full[step]
        assert torch.equal(qb.batch.input_ids, ref.batch.input_ids)
        assert [s.prompt for s in qb.samples] == [s.prompt for s in ref.samples]
        q2.publish([], version=step + 1)
    q2.close()


def test_errors_are_clear():
    eng = FakeEngine()
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutQueue(eng, prompts(4), groups_per_batch=1, max_staleness=-1)
    with pytest.raises(ValueError, match="groups_per_batch"):
        RolloutQueue(eng, prompts(4), groups_per_batch=0)
    with pytest.raises(ValueError, match="top_p"):
        RolloutQueue(eng, prompts(4), groups_per_batch=1, sampling=SamplingParams(top_p=2.0))
    q = RolloutQueue(eng, prompts(3), groups_per_batch=2, sampling=SamplingParams(max_new_tokens=2))
    q.start()
    with pytest.raises(ValueError, match="out of order"):
        q.get_batch(1)
    q.get_batch(0, timeout=10)
    with pytest.raises(RuntimeError, match="version >= 1"):  # forgot to publish (synchronous)
        q.get_batch(1, timeout=10)
    q.publish([], version=1)
    with pytest.raises(PromptsExhausted):
        q.get_batch(1, timeout=10)
    q.close()
    # an error in the producer (an invalid prompt) surfaces in get_batch, not as a hang
    q = RolloutQueue(eng, [{"prompt_ids": []}], groups_per_batch=1)
    q.start()
    with pytest.raises(RuntimeError, match="producer") as info:
        q.get_batch(0, timeout=10)
    assert "empty prompt" in str(info.value.__cause__)
    q.close()


def test_close_aborts_a_running_generation():
    eng = FakeEngine(step_s=0.01)
    q = RolloutQueue(
        eng, prompts(4), groups_per_batch=1, sampling=SamplingParams(max_new_tokens=10_000 // 4)
    )
    q.start()
    time.sleep(0.05)
    t0 = time.time()
    q.close()
    assert time.time() - t0 < 5


def test_prompt_ids_of_and_collate_checks():
    assert prompt_ids_of([3, 4]) == [3, 4]
    assert prompt_ids_of({"prompt_ids": torch.tensor([5])}) == [5]
    with pytest.raises(KeyError, match="prompt_ids"):
        prompt_ids_of({"ids": [1]})
    c = Completion("a", [1, 2], [], [], [], "abort")
    b = collate_completions([c], [0])
    assert b.response_mask.shape == (1, 1) and b.response_mask.sum() == 0
    with pytest.raises(ValueError, match="same length"):
        Completion("a", [1], [1, 2], [0.0], [0], "stop")
    assert isinstance(GenerateRequest([1]).params, SamplingParams)


def test_collate_pads_prompts_left_and_responses_right():
    """Every field of the batch, cell by cell, for rows of different prompt/response lengths."""
    cs = [
        Completion("a", [7, 8, 9], [4, 5], [-0.5, -1.25], [2, 3], "stop"),
        Completion("b", [6], [1, 2, 3], [-0.1, -0.2, -0.3], [1, 1, 2], "length"),
        Completion("c", [5, 4], [], [], [], "stop"),
    ]
    b = collate_completions(cs, [0, 0, 1], [1.0, 0.5, 0.0], pad_id=99)
    assert b.input_ids.tolist() == [
        [7, 8, 9, 4, 5, 99],
        [99, 99, 6, 1, 2, 3],
        [99, 5, 4, 99, 99, 99],
    ]
    assert b.attention_mask.tolist() == [
        [True, True, True, True, True, False],
        [False, False, True, True, True, True],
        [False, True, True, False, False, False],
    ]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 0, 0, 1, 2, 3], [0, 0, 1, 0, 0, 0]]
    assert b.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    expected_lp = [[-0.5, -1.25, 0.0], [-0.1, -0.2, -0.3], [0.0, 0.0, 0.0]]
    assert torch.equal(b.rollout_logprobs, torch.tensor(expected_lp, dtype=torch.float32))
    assert b.versions.tolist() == [[2, 3, -1], [1, 1, 2], [-1, -1, -1]]
    assert b.rewards.tolist() == [1.0, 0.5, 0.0] and b.group_ids.tolist() == [0, 0, 1]
    assert b.truncated.tolist() == [False, True, False]
    assert (b.input_ids.dtype, b.attention_mask.dtype, b.response_mask.dtype) == (
        torch.long,
        torch.bool,
        torch.float32,
    )
    assert (b.rollout_logprobs.dtype, b.versions.dtype) == (torch.float32, torch.long)


# ---------------------------------------------------------------------------------------------
# With a real TorchEngine on a tiny model


@pytest.fixture
def tiny():
    from minippo.models import Transformer, init_weights, qwen3_tiny

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest on shared cores
    models = [init_weights(Transformer(qwen3_tiny()), seed=s, std=0.1) for s in (0, 1, 2)]
    yield models
    torch.set_num_threads(before)


def _check_batch_against_models(qb, models, step):
    """Every token's rollout logprob equals the teacher-forced logprob of its version's model."""
    from minippo.models import token_logprobs

    b = qb.batch
    for version in b.versions[b.versions >= 0].unique().tolist():
        with torch.no_grad():
            lp = token_logprobs(
                models[version],
                b.input_ids,
                attention_mask=b.attention_mask,
                position_ids=b.position_ids,
                temperature=1.0,
                start=b.prompt_len,
            )
        sel = b.versions == version
        assert (lp[sel] - b.rollout_logprobs[sel]).abs().max() <= 1e-4
        assert step - version <= qb.metrics["rollout/staleness_max"]


@pytest.mark.parametrize("partial", [False, True])
def test_queue_with_torch_engine(tiny, partial):
    from minippo.engine import TorchEngine
    from tests.engine_suite import publish_model

    with publish_model(TorchEngine(tiny[0].args, in_process=True), tiny[0]) as eng:
        q = RolloutQueue(
            eng,
            prompts(20),
            groups_per_batch=2,
            samples_per_prompt=3,
            sampling=SamplingParams(max_new_tokens=40, stop_token_ids=(5,)),
            max_staleness=1,
            partial_rollout=partial,
            seed=3,
        )
        q.start()
        for step in range(3):
            qb = q.get_batch(step, timeout=60)
            v = qb.batch.versions[qb.batch.versions >= 0]
            assert int(v.min()) >= step - 1 and int(v.max()) <= step
            _check_batch_against_models(qb, tiny, step)
            if step < 2:
                named = [(n, p.detach()) for n, p in tiny[step + 1].named_parameters()]
                q.publish([named], version=step + 1)
        q.close()


def test_batch_metrics_reward_spread_and_zero_variance_groups():
    from minippo.rl.types import RolloutBatch
    from minippo.training.rollout_queue import batch_metrics

    # 3 groups of 2: group 0 scored (1, 1), group 1 (0, 0.5), group 2 (0.25, 0.25)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.25, 0.25])
    B = rewards.numel()
    batch = RolloutBatch(
        input_ids=torch.zeros(B, 3, dtype=torch.long),
        attention_mask=torch.ones(B, 3, dtype=torch.bool),
        position_ids=torch.arange(3).expand(B, 3),
        response_mask=torch.ones(B, 1),
        rollout_logprobs=torch.zeros(B, 1),
        versions=torch.zeros(B, 1, dtype=torch.long),
        rewards=rewards,
        group_ids=torch.tensor([7, 7, 3, 3, 9, 9]),
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    m = batch_metrics(batch, 1.0, has_rewards=True)
    assert m["rollout/zero_variance_groups"] == pytest.approx(2 / 3)
    assert m["rollout/reward_mean"] == pytest.approx(0.5)
    assert m["rollout/reward_std"] == pytest.approx(float(rewards.std(correction=0)))
    assert "rollout/zero_variance_groups" not in batch_metrics(batch, 1.0, has_rewards=False)
