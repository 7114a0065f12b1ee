"""RolloutQueue in ``rollout.mode: alternate`` with a real TorchEngine on a tiny model.

Each weight version is a distinct random model; several stop ids make the response lengths
geometric, so groups finish at different steps and some are carried over.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace

import pytest
import torch

from minippo.engine import SamplingParams
from minippo.engine.torch_engine import TorchEngine
from minippo.models import Transformer, hf_name, init_weights, qwen3_tiny
from minippo.training.rollout_queue import RolloutQueue
from tests.engine_suite import one_torch_thread  # noqa: F401 (autouse: one torch thread)

ARGS = qwen3_tiny()
STOPS = tuple(range(0, ARGS.vocab_size, 6))  # about 1 token in 6 ends a response
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=STOPS)
_MODELS: dict[int, Transformer] = {}


def weights(version: int):
    if version not in _MODELS:
        _MODELS[version] = init_weights(Transformer(ARGS), seed=500 + version, std=0.1).eval()
    return [[(hf_name(n), p.detach()) for n, p in _MODELS[version].named_parameters()]]


def prompts():
    i = 0
    while True:
        yield [1 + i % 7, 2 + i % 5, 3]
        i += 1


class Recording:
    """A TorchEngine that records the protocol calls the queue makes."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine, self.calls, self.streams = engine, [], []

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if name in ("wake", "sleep", "publish_weights", "pause", "resume", "abort"):

            def recorded(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)

            return recorded
        return attr

    def stream(self, requests, *, until_groups=None):
        self.calls.append("stream")
        self.streams.append(list(requests))
        return self.engine.stream(requests, until_groups=until_groups)


@pytest.fixture
def engine():
    eng = TorchEngine(ARGS, in_process=True)
    yield Recording(eng)
    eng.shutdown()


def make_queue(engine, **kw) -> RolloutQueue:
    opts = dict(groups_per_batch=4, samples_per_prompt=2, sampling=SAMPLING, max_staleness=1)
    opts |= dict(mode="alternate", partial_rollout=True)
    return RolloutQueue(engine, prompts(), **(opts | kw))


def run(queue, steps: int, start: int = 0):
    """publish(s) then get_batch(s), as the recipe does; the batches."""
    out = []
    for s in range(start, start + steps):
        queue.publish(weights(s), version=s)
        out.append(queue.get_batch(s))
    return out


def test_schedule_carries_groups_across_versions_within_the_bound(engine):
    queue = make_queue(engine, oversample=2.0)
    queue.start()
    batches = run(queue, 6)
    # per step: wake (not before the first publish: the engine starts awake), publish, stream, sleep
    assert (
        engine.calls
        == ["publish_weights", "stream", "sleep"]
        + ["wake", "publish_weights", "stream", "sleep"] * 5
    )
    continued = [r for reqs in engine.streams[1:] for r in reqs if len(r.prompt_ids) > 3]
    assert continued, "no carried request was continued"
    spans = 0
    for s, b in enumerate(batches):
        assert b.batch.batch_size == 8
        v = b.batch.versions[b.batch.response_mask > 0]
        assert int(v.min()) >= s - 1 and int(v.max()) == s
        assert b.metrics["rollout/groups_in_flight"] == 8
        spans += int(b.metrics["rollout/multi_version_fraction"] * 8)
        # rows of one group are adjacent; groups in submission order
        assert b.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        for row, sample in enumerate(b.samples):
            c = sample.completion
            assert c.finish_reason in ("stop", "length")
            assert len(c.token_ids) <= SAMPLING.max_new_tokens
            assert b.batch.versions[row, : len(c.versions)].tolist() == c.versions
    assert spans > 0, "no trained sample spans two versions"
    assert sum(b.metrics["rollout/carried_over"] for b in batches) > 0
    # what keep_old_actor must keep: exactly the versions of the carried tokens
    carried = {v for g in queue._groups for s in g.samples if s.done for v in s.done.versions}
    assert queue.referenced_versions() == {v for v in carried if v >= 6 - 1}  # the rest restart


def test_stale_carried_samples_restart_from_the_prompt(engine):
    queue = make_queue(engine, oversample=2.0, max_staleness=0)
    queue.start()
    batches = run(queue, 5)
    for s, b in enumerate(batches):
        v = b.batch.versions[b.batch.response_mask > 0]
        assert v.unique().tolist() == [s]  # synchronous: every token of version s
    assert batches[-1].metrics["rollout/restarted_total"] > 0


def test_without_partial_rollouts_no_sample_spans_two_versions(engine):
    queue = make_queue(engine, oversample=2.0, partial_rollout=False)
    queue.start()
    for b in run(queue, 5):
        assert b.metrics["rollout/multi_version_fraction"] == 0.0


def test_oversample_one_equals_the_synchronous_overlap_queue():
    """Same prompts, seeds and weights: alternate (oversample 1) samples what the overlap queue
    with max_staleness 0 samples, token for token."""
    got = {}
    for mode in ("alternate", "overlap"):
        eng = TorchEngine(ARGS, in_process=True)
        try:
            opts = dict(groups_per_batch=4, samples_per_prompt=2, sampling=SAMPLING)
            q = RolloutQueue(eng, prompts(), max_staleness=0, mode=mode, **opts)
            q.publish(weights(0), version=0)
            q.start()
            got[mode] = []
            for s in range(3):
                b = q.get_batch(s)
                got[mode].append([x.completion.token_ids for x in b.samples])
                q.publish(weights(s + 1), version=s + 1)
            q.close()
        finally:
            eng.shutdown()
    assert got["alternate"] == got["overlap"]


def test_resume_from_state_dict_gives_the_same_batches():
    def fresh():
        return TorchEngine(ARGS, in_process=True)

    eng = fresh()
    queue = make_queue(eng, oversample=1.5)
    queue.start()
    run(queue, 2)
    state = pickle.loads(pickle.dumps(queue.state_dict()))  # as a checkpoint stores it
    rest = run(queue, 3, start=2)
    eng.shutdown()

    eng2 = fresh()
    resumed = make_queue(eng2, oversample=1.5)
    resumed.load_state_dict(copy.deepcopy(state))
    resumed.start()
    again = run(resumed, 3, start=2)
    eng2.shutdown()
    for a, b in zip(rest, again):
        assert torch.equal(a.batch.input_ids, b.batch.input_ids)
        assert torch.equal(a.batch.versions, b.batch.versions)
        assert torch.equal(a.batch.rollout_logprobs, b.batch.rollout_logprobs)


def test_get_batch_needs_the_weights_of_its_step(engine):
    queue = make_queue(engine)
    queue.publish(weights(0), version=0)
    queue.start()
    queue.get_batch(0)
    with pytest.raises(RuntimeError, match="publish them first"):
        queue.get_batch(1)


@pytest.mark.parametrize("bad", [0.5, float("nan")])
def test_oversample_below_one_is_refused(engine, bad):
    with pytest.raises(ValueError, match="oversample"):
        make_queue(engine, oversample=bad)


def test_resume_refuses_other_queue_settings(engine):
    """A saved queue state holds versions counted in publishes and carried groups of
    samples_per_prompt samples: a run with another mode, sync_every or group size is refused
    with the key to set, before anything is restored."""
    queue = make_queue(engine)
    queue.start()
    run(queue, 1)
    state = queue.state_dict()
    assert (state["mode"], state["sync_every"], state["samples_per_prompt"]) == ("alternate", 1, 2)
    overlap = RolloutQueue(engine, prompts(), groups_per_batch=4, samples_per_prompt=2)
    with pytest.raises(ValueError, match=r"saved with rollout.mode=alternate; resume with"):
        overlap.load_state_dict(state)
    with pytest.raises(ValueError, match=r"rollout.samples_per_prompt=2, this run has"):
        make_queue(engine, samples_per_prompt=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"resume with rollout.sync_every=1"):
        make_queue(engine, sync_every=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with rollout.mode=overlap"):
        make_queue(engine).load_state_dict({**overlap.state_dict(), "mode": "overlap"})


def test_tokens_per_s_counts_the_tokens_generated_in_the_step(engine):
    """A batch holds tokens carried from earlier steps, and the step also generates tokens of
    groups it carries on: the rate is what the engine produced during this step's generation."""
    queue = make_queue(engine, oversample=2.0)
    queue.start()
    batches = run(queue, 4)
    total = 0.0
    carried = False
    for b in batches:
        m = b.metrics
        produced = m["rollout/tokens_total"] - total
        total = m["rollout/tokens_total"]
        assert m["rollout/tokens_per_s"] * m["rollout/gen_time_s"] == pytest.approx(
            produced, rel=1e-9
        )
        carried |= produced != m["rollout/tokens"]
    assert carried  # the case the rate must not get wrong occurred


def test_rows_past_the_first_wave_carry_no_partial_tokens(caplog):
    """TorchEngine decodes waves of ``max_batch_size`` rows, each to its end. With room for just
    the batch's rows, the first wave holds the batch's groups and the over-provisioned ones never
    start before the stop: no partial rollout. The recipe warns about that setting."""
    from minippo.training import preflight

    eng = TorchEngine(ARGS, in_process=True, max_batch_size=8)  # 4 groups x 2 samples
    try:
        queue = make_queue(eng, oversample=2.0)  # 8 groups, 16 rows in flight
        queue.start()
        for b in run(queue, 3):
            assert b.metrics["rollout/multi_version_fraction"] == 0
            assert b.metrics["rollout/carried_over"] == 4
        assert all(s.done is None for g in queue._groups for s in g.samples)
    finally:
        eng.shutdown()
    with caplog.at_level("WARNING"):
        preflight.warn_if_oversample_waits(16, 8, max_batch_size=16)
        assert not caplog.records
        preflight.warn_if_oversample_waits(16, 8, max_batch_size=8)
    (record,) = caplog.records
    assert "engine.max_batch_size=8" in record.getMessage()
    assert "set engine.max_batch_size=16" in record.getMessage()


class AbortsTheFinished(Recording):
    """An engine whose stop labels "abort" the requests that finished in the step that completed
    the k-th group, as SGLang 0.5.23 does (its abort wins over the stop and length checks)."""

    def stream(self, requests, *, until_groups=None):
        groups = {}
        for r in requests:
            groups.setdefault(r.group or r.request_id, set()).add(r.request_id)
        done: set[str] = set()
        complete = 0
        for c in super().stream(requests, until_groups=until_groups):
            if until_groups is not None and complete >= until_groups and c.finish_reason != "abort":
                c = replace(c, finish_reason="abort")
            elif c.finish_reason != "abort":
                done.add(c.request_id)
                group = next(g for g, ids in groups.items() if c.request_id in ids)
                complete += groups[group] <= done
            yield c


def test_a_sample_labelled_abort_in_its_finishing_step_is_not_continued():
    """Every request ends at step 4 (no stop ids), so the groups beyond the batch's come back as
    "abort" holding all their tokens: they are finished samples, trained as they are, never
    continued with no budget left (max_new_tokens 0) or past a stop id."""
    eng = TorchEngine(ARGS, in_process=True)
    try:
        wrapped = AbortsTheFinished(eng)
        queue = make_queue(wrapped, oversample=2.0, sampling=SamplingParams(max_new_tokens=4))
        queue.start()
        batches = run(queue, 3)
    finally:
        eng.shutdown()
    for b in batches:
        for sample in b.samples:
            assert sample.completion.finish_reason == "length"
            assert len(sample.completion.token_ids) == 4
    assert sum(b.metrics["rollout/carried_over"] for b in batches) > 0  # the case occurred
    continued = [r for reqs in wrapped.streams[1:] for r in reqs if len(r.prompt_ids) > 3]
    assert not continued, "a finished sample was continued"


def test_a_state_of_the_earlier_sample_format_resumes_as_the_current_one(engine):
    """A checkpoint written before single-turn samples were one-turn episodes holds carried
    samples with their tokens, finish reason and reward but no episode (and a ``multi_turn``
    field): they load as one-turn episodes, and the run goes on exactly as from a state of the
    current format (finished samples are trained as they are, partial ones continued)."""

    def reward(sample):
        return float(len(sample.completion.token_ids))

    queue = make_queue(engine, oversample=2.0, reward_fn=reward)
    queue.start()
    run(queue, 2)
    state = pickle.loads(pickle.dumps(queue.state_dict()))
    earlier = copy.deepcopy(state)
    finished = partial = 0
    for s in (s for g in earlier["carried"] for s in g.samples):
        if s.finished:  # that format scored a sample as soon as it finished
            s.reward = float(len(s.done.token_ids))
            finished += 1
        partial += s.done is not None and not s.finished
        s.episode = None
        vars(s)["multi_turn"] = False
    assert finished and partial  # both kinds are carried
    batches = {}
    for name, saved in (("current", state), ("earlier", earlier)):
        eng = TorchEngine(ARGS, in_process=True)
        try:
            resumed = make_queue(eng, oversample=2.0, reward_fn=reward)
            resumed.load_state_dict(pickle.loads(pickle.dumps(saved)))
            resumed.start()
            batches[name] = run(resumed, 3, start=2)
        finally:
            eng.shutdown()
    for a, b in zip(batches["current"], batches["earlier"], strict=True):
        assert torch.equal(a.batch.input_ids, b.batch.input_ids)
        assert torch.equal(a.batch.versions, b.batch.versions)
        assert torch.equal(a.batch.rollout_logprobs, b.batch.rollout_logprobs)
        assert torch.equal(a.batch.rewards, b.batch.rewards)
        assert [s.turns for s in a.samples] == [s.turns for s in b.samples] == [1] * 8
