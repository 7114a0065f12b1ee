"""Multi-turn episodes on the one rollout queue: token in / token out, the trajectory layout
(observation tokens: version -1, logprob 0, response_mask 0, attended), budgets and faults."""

from __future__ import annotations

import itertools
import pickle
import threading
import time

import pytest
import torch

from minippo.engine import Completion, GenerateRequest, SamplingParams, validate_requests
from minippo.env import EnvError, MultiTurn, StepResult, observation_encoder
from minippo.models import TinyTokenizer
from minippo.training.rollout_queue import RolloutQueue

STOP = 9  # the scripted engine's turn ends with this id
OBS = [40, 41]  # the scripted environment's observation


class ScriptedEngine:
    """Answers every request with ``turn_len`` tokens (the last one STOP), logprob -0.5 each,
    stamped with its version. Records every request."""

    def __init__(self, turn_len: int = 3) -> None:
        self.version = 0
        self.turn_len = turn_len
        self.requests: list[GenerateRequest] = []

    def generate(self, requests):
        validate_requests(requests, max_seq_len=4096, vocab_size=51)
        out = []
        for r in requests:
            self.requests.append(r)
            n = min(self.turn_len, r.params.max_new_tokens)
            base = len(r.prompt_ids) + (r.params.seed or 0)  # the request's seed matters
            toks = [10 + (base + k) % 20 for k in range(n - 1)] + [STOP]
            toks = toks[:n]
            reason = "stop" if toks[-1] in r.params.stop_token_ids else "length"
            lps, vs = [-0.5] * n, [self.version] * n
            out.append(Completion(r.request_id, list(r.prompt_ids), toks, lps, vs, reason))
        return out

    def stream(self, requests, *, until_groups=None):
        yield from self.generate(requests)

    def publish_weights(self, buckets, version):
        self.version = version

    def pause(self): ...
    def resume(self): ...
    def abort(self):
        return []

    def sleep(self): ...
    def wake(self): ...
    def shutdown(self): ...


class ThreeTurns:
    """Answers turns 0 and 1 with OBS; ends the episode after turn 2 with reward 1."""

    stop_tokens = ()

    def reset(self, prompt, seed):
        return {"turns": []}

    def step(self, state, turn):
        state["turns"].append(list(turn.token_ids))
        if turn.index < 2:
            return StepResult(observation=list(OBS))
        return StepResult(reward=1.0)


def multi(env, **kw) -> MultiTurn:
    opts = dict(encode_observation=None, vocab_size=51, max_turns=4, max_turn_tokens=8)
    return MultiTurn(env, **(opts | kw))


def make_queue(engine, env, *, max_new=32, mode="overlap", **kw) -> RolloutQueue:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=(STOP,))
    opts = dict(groups_per_batch=2, samples_per_prompt=2, sampling=sampling, max_staleness=100)
    mt = kw.pop("multi_turn", None) or multi(env)
    return RolloutQueue(engine, iter([[1, 2, 3]] * 100), mode=mode, multi_turn=mt, **(opts | kw))


def test_each_turn_requests_the_exact_context_and_the_layout_marks_observations():
    eng = ScriptedEngine(turn_len=3)
    with make_queue(eng, ThreeTurns(), max_staleness=0) as queue:  # nothing generated ahead
        queue.start()
        b = queue.get_batch(0)
    # every turn's request is the previous request + its completion + the observation
    by_sample: dict[str, list[GenerateRequest]] = {}
    for r in eng.requests:
        by_sample.setdefault(r.request_id.split("-a")[0], []).append(r)
    assert len(by_sample) == 4 and all(len(rs) == 3 for rs in by_sample.values())
    for rs in by_sample.values():
        for prev, nxt in itertools.pairwise(rs):
            sampled = nxt.prompt_ids[len(prev.prompt_ids) : len(nxt.prompt_ids) - len(OBS)]
            assert nxt.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
            assert len(sampled) == 3 and sampled[-1] == STOP
            assert nxt.prompt_ids[-len(OBS) :] == OBS
    # layout of one row: model | obs | model | obs | model
    rb = b.batch
    assert rb.versions[0].tolist() == [0, 0, 0, -1, -1, 0, 0, 0, -1, -1, 0, 0, 0]
    assert rb.response_mask[0].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert rb.rollout_logprobs[0].tolist() == [-0.5] * 3 + [0, 0] + [-0.5] * 3 + [0, 0] + [-0.5] * 3
    P = rb.prompt_len
    assert rb.input_ids[0, P + 3 : P + 5].tolist() == OBS
    assert rb.attention_mask[0].all()  # observations are attended to (positions of their own)
    assert rb.position_ids[0].tolist() == list(range(P + 13))
    assert rb.rewards.tolist() == [1.0] * 4
    assert b.metrics["rollout/turns_mean"] == 3.0 and b.metrics["rollout/obs_tokens_mean"] == 4.0
    assert b.metrics["rollout/response_len_mean"] == 9.0  # model tokens only
    assert b.samples[0].completion.finish_reason == "stop"


def test_alternate_carries_episodes_with_their_state_and_versions():
    """Over-provisioned groups carried into the next step continue their episodes: the env state
    holds every turn, the versions run 0.. across turns; the staleness bound restarts the rest."""

    class SlowGroup(ThreeTurns):  # episodes of odd prompts take 3 turns, even ones 1
        def step(self, state, turn):
            state["turns"].append(list(turn.token_ids))
            if state["long"] and turn.index < 2:
                return StepResult(observation=list(OBS))
            return StepResult(reward=float(len(state["turns"])))

        def reset(self, prompt, seed):
            return {"turns": [], "long": prompt[0] % 2 == 1}

    eng = ScriptedEngine(turn_len=2)
    prompts = iter([[k, 5, 6] for k in range(2, 100)])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(STOP,))
    queue = RolloutQueue(
        eng, prompts, groups_per_batch=1, samples_per_prompt=1, sampling=sampling,
        max_staleness=2, mode="alternate", oversample=2.0, partial_rollout=True,
        multi_turn=multi(SlowGroup()),
    )  # fmt: skip
    queue.start()
    seen = []
    for step in range(4):
        queue.publish([], version=step)
        b = queue.get_batch(step)
        seen.append((b.samples[0].prompt[0], b.batch.versions[0].tolist(), b.samples[0].reward))
    queue.close()
    # step 0: prompt 2 (one turn) completes; prompt 3 (three turns) is carried after its first
    assert seen[0] == (2, [0, 0], 1.0)
    assert seen[1] == (4, [1, 1], 1.0)
    # prompt 3: a turn per step, each under that step's weights; the env's state held all three
    assert seen[2] == (3, [0, 0, -1, -1, 1, 1, -1, -1, 2, 2], 3.0)


class Recording(ScriptedEngine):
    """A ScriptedEngine that records each stream call's ``until_groups``."""

    def __init__(self, turn_len: int = 3) -> None:
        super().__init__(turn_len)
        self.until: list[int | None] = []

    def stream(self, requests, *, until_groups=None):
        self.until.append(until_groups)
        yield from self.generate(requests)


@pytest.mark.parametrize("max_new, max_turns", [(32, 3), (9, 4)])
def test_only_a_certainly_last_turn_may_complete_its_group(max_new, max_turns):
    """Turns of 2 tokens, observations of 2: a turn at offset 4k is turn k. It may complete its
    group (``completes_group``) only when it is certainly the episode's last: turn max_turns (the
    third of 3), or the turn that has one token of the budget left (offset 8 of 9). Alternate
    streams each round with until_groups = the groups still missing."""
    eng = Recording(turn_len=2)
    mt = multi(ThreeTurns(), max_turns=max_turns)
    with make_queue(eng, None, max_new=max_new, mode="alternate", multi_turn=mt) as queue:
        queue.publish([], version=0)
        queue.start()
        queue.get_batch(0)
    offsets = [int(r.request_id.rsplit("-o", 1)[1]) for r in eng.requests]
    assert sorted(set(offsets)) == [0, 4, 8]
    assert all(r.completes_group == (o == 8) for r, o in zip(eng.requests, offsets))
    assert eng.until == [2, 2, 2]  # no group is complete before the last round


def test_single_turn_requests_may_all_complete_their_group():
    eng = Recording(turn_len=3)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(STOP,))
    queue = RolloutQueue(
        eng, iter([[1, 2, 3]] * 10), groups_per_batch=2, samples_per_prompt=2, sampling=sampling,
        mode="alternate", oversample=1.5, reward_fn=lambda s: 1.0,
    )  # fmt: skip
    with queue:
        queue.publish([], version=0)
        queue.start()
        b = queue.get_batch(0)
    assert len(eng.requests) == 6 and all(r.completes_group for r in eng.requests)
    assert eng.until == [2]  # one stream, stopped once 2 groups are complete
    assert [s.turns for s in b.samples] == [1] * 4 and b.batch.rewards.tolist() == [1.0] * 4


class SlowOdd(ThreeTurns):
    """Episodes of odd prompts take three turns, even ones one; the reward counts the turns the
    state saw (a state lost on resume would give a different reward)."""

    def reset(self, prompt, seed):
        return {"turns": [], "long": prompt[0] % 2 == 1, "seed": seed}

    def step(self, state, turn):
        state["turns"].append(list(turn.token_ids))
        if state["long"] and turn.index < 2:
            return StepResult(observation=[40 + turn.index])
        return StepResult(reward=float(len(state["turns"])) + state["seed"] % 7 / 10)


def alternate_queue(eng):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(STOP,))
    return RolloutQueue(
        eng, [[k, 5, 6] for k in range(2, 100)], groups_per_batch=1, samples_per_prompt=2,
        sampling=sampling, max_staleness=2, mode="alternate", oversample=2.0,
        partial_rollout=True, multi_turn=multi(SlowOdd()), seed=3,
    )  # fmt: skip


def test_resume_with_episodes_in_flight_equals_the_uninterrupted_run():
    """The queue's state saves the carried episodes with their environment state (pickled, as a
    checkpoint does); a resumed queue with a fresh environment continues them exactly."""

    def run(queue, steps):
        out = []
        for step in steps:
            queue.publish([], version=step)
            b = queue.get_batch(step)
            out.append((b.batch.input_ids.tolist(), b.batch.versions.tolist(), b.samples))
        return out

    whole = alternate_queue(ScriptedEngine(turn_len=2))
    whole.start()
    full = run(whole, range(5))
    whole.close()
    first = alternate_queue(ScriptedEngine(turn_len=2))
    first.start()
    head = run(first, range(2))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    first.close()
    mid_episode = [s for g in state["carried"] for s in g.samples if not s.finished]
    assert mid_episode and all(s.episode.turns >= 1 for s in mid_episode)
    resumed = alternate_queue(ScriptedEngine(turn_len=2))
    resumed.load_state_dict(state)
    resumed.start()
    tail = run(resumed, range(2, 5))
    resumed.close()
    for (ids, versions, samples), (ids2, versions2, samples2) in zip(full, head + tail):
        assert ids == ids2 and versions == versions2
        assert [s.reward for s in samples] == [s.reward for s in samples2]
        assert [s.turns for s in samples] == [s.turns for s in samples2]
    assert any(
        -1 in row and max(row) > min(v for v in row if v >= 0) for _, v, _ in full for row in v
    )


def test_observation_past_the_budget_is_cut_and_counted():
    class Verbose(ThreeTurns):
        def step(self, state, turn):
            return StepResult(observation=[40] * 50, reward=0.5)

    eng = ScriptedEngine(turn_len=3)
    with make_queue(eng, Verbose(), max_new=10) as queue:
        queue.start()
        b = queue.get_batch(0)
    assert b.batch.response_mask.shape[1] == 10  # the budget counts observation tokens
    assert b.batch.versions[0].tolist() == [0, 0, 0] + [-1] * 7
    assert b.batch.truncated.all() and b.metrics["rollout/obs_truncated"] == 4.0
    assert b.batch.rewards.tolist() == [0.5] * 4


def test_max_turns_ends_the_episode_truncated():
    class Endless(ThreeTurns):
        def step(self, state, turn):
            return StepResult(observation=[40], reward=float(turn.last))

    eng = ScriptedEngine(turn_len=2)
    with make_queue(eng, Endless(), multi_turn=multi(Endless(), max_turns=2)) as queue:
        queue.start()
        b = queue.get_batch(0)
    assert b.metrics["rollout/turns_mean"] == 2.0
    assert b.batch.versions[0].tolist() == [0, 0, -1, 0, 0]  # the last observation dropped
    assert b.batch.truncated.all() and b.batch.rewards.tolist() == [1.0] * 4


class Faulty(ThreeTurns):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.release = threading.Event()

    def step(self, state, turn):
        if self.kind == "raise":
            raise KeyError("no such tool")
        if self.kind == "hang":
            self.release.wait(30)
            return StepResult(reward=1.0)
        if self.kind == "vocab":
            return StepResult(observation=[3, 999])
        return "not a result"


@pytest.mark.parametrize(
    "kind, words",
    [
        ("raise", "raised KeyError: 'no such tool'"),
        ("hang", "did not answer within multi_turn.step_timeout_s=0.2"),
        ("vocab", "outside the vocabulary [0, 51)"),
        ("type", "returned a str, expected a minippo.env.StepResult"),
    ],
)
def test_bad_environment_stops_with_one_line_or_scores_zero(kind, words):
    before = set(threading.enumerate())
    env = Faulty(kind)
    queue = make_queue(ScriptedEngine(), env, multi_turn=multi(env, step_timeout_s=0.2))
    queue.start()
    with pytest.raises(RuntimeError) as info:
        queue.get_batch(0)
    err = info.value.__cause__
    assert isinstance(err, EnvError)
    line = str(err)
    assert "\n" not in line and line.startswith("environment Faulty step (turn 0) ")
    assert words in line and " for sample 0, completion " in line  # names the prompt's sample
    env.release.set()
    queue.close()
    # counted outcome: reward 0, a metric, and the run goes on
    env = Faulty(kind)
    mt = multi(env, step_timeout_s=0.2, on_error="zero_reward")
    with make_queue(ScriptedEngine(), env, multi_turn=mt) as queue:
        queue.start()
        b = queue.get_batch(0)
        env.release.set()
    assert b.batch.rewards.tolist() == [0.0] * 4
    key = "rollout/env_timeouts" if kind == "hang" else "rollout/env_errors"
    assert b.metrics[key] == 4.0 and b.metrics[key + "_total"] >= 4.0  # + batches ahead
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, "threads left behind"


def test_env_steps_run_concurrently_across_episodes():
    class Sleepy(ThreeTurns):
        def step(self, state, turn):
            time.sleep(0.3)
            return StepResult(reward=1.0)

    env = Sleepy()
    mt = multi(env, workers=4)
    with make_queue(ScriptedEngine(), env, multi_turn=mt, max_staleness=0) as queue:
        t0 = time.perf_counter()
        queue.start()
        queue.get_batch(0)
        seconds = time.perf_counter() - t0
    assert seconds < 0.3 * 4 * 0.6  # the 4 episodes' steps at once, not one after another


def test_observation_encoder_without_a_chat_template_encodes_the_text():
    tok = TinyTokenizer()
    enc = observation_encoder(tok)
    assert enc("no:12\n", 5) == tok.encode("no:12\n")


def test_torch_engine_episodes_keep_exact_per_token_versions_across_turns_and_publishes():
    """Overlap with partial rollouts: publishes land while episodes are mid-turn or between
    turns; every model token's logprob equals the teacher-forced logprob of its own version's
    weights over the whole context (observations included), so versions and positions are exact
    across turns."""
    from minippo.engine import TorchEngine
    from minippo.models import Transformer, init_weights, qwen3_tiny, token_logprobs
    from tests.engine_suite import publish_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    nets = [init_weights(Transformer(qwen3_tiny()), seed=s, std=0.1) for s in (0, 1, 2)]
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=(5,))
    spans = 0
    try:
        with publish_model(TorchEngine(nets[0].args, in_process=True), nets[0]) as eng:
            q = RolloutQueue(
                eng, iter([[1 + i % 7, 2, 3] for i in range(40)]), groups_per_batch=2,
                samples_per_prompt=2, sampling=sampling, max_staleness=1, partial_rollout=True,
                seed=3, multi_turn=multi(ThreeTurns(), max_turn_tokens=6),
            )  # fmt: skip
            q.start()
            for step in range(3):
                b = q.get_batch(step, timeout=120).batch
                assert ((b.versions == -1) == (b.response_mask == 0)).all()
                assert (b.rollout_logprobs[b.response_mask == 0] == 0).all()
                for version in b.versions[b.versions >= 0].unique().tolist():
                    with torch.no_grad():
                        lp = token_logprobs(
                            nets[version], b.input_ids, attention_mask=b.attention_mask,
                            position_ids=b.position_ids, start=b.prompt_len,
                        )  # fmt: skip
                    sel = b.versions == version
                    assert (lp[sel] - b.rollout_logprobs[sel]).abs().max() <= 1e-4
                v = torch.where(b.versions >= 0, b.versions, 99)
                spans += int((v.amin(1) < b.versions.amax(1)).sum())
                if step < 2:
                    named = [(n, p.detach()) for n, p in nets[step + 1].named_parameters()]
                    q.publish([named], version=step + 1)
            q.close()
    finally:
        torch.set_num_threads(before)
    print(f"rows spanning two versions: {spans}")


class Recorded(ThreeTurns):
    """ThreeTurns that keeps each episode's state by its seed (a restart replaces it)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def reset(self, prompt, seed):
        self.states[seed] = state = {"turns": []}
        return state


def model_turns(versions: list[int]) -> list[list[int]]:
    """The positions of each model turn of a response (runs of sampled tokens)."""
    turns: list[list[int]] = []
    for i, v in enumerate(versions):
        if v < 0:
            continue
        if i == 0 or versions[i - 1] < 0:
            turns.append([])
        turns[-1].append(i)
    return turns


def test_alternate_cuts_episodes_mid_turn_and_continues_them_under_the_next_weights():
    """Alternate with over-provisioned groups: once enough groups whose episodes are all on
    their last turn are complete, the engine stops the round and the other episodes are cut
    mid-turn, wherever they are. Carried into the next step they continue that turn under the
    new weights: some turn's tokens carry two versions, each token's logprob is the
    teacher-forced logprob of its own version's weights, and the environment saw each turn once
    and whole (its state was kept)."""
    from minippo.engine import TorchEngine
    from minippo.models import Transformer, hf_name, init_weights, qwen3_tiny, token_logprobs
    from minippo.training.rollout_queue import sample_seed

    args = qwen3_tiny()
    nets = [init_weights(Transformer(args), seed=10 + s, std=0.1).eval() for s in range(5)]
    stops = tuple(range(0, args.vocab_size, 5))  # turns of geometric length, capped at 6
    sampling = SamplingParams(max_new_tokens=24, stop_token_ids=stops)
    env = Recorded()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = TorchEngine(args, in_process=True)
    cut_turns = 0
    try:
        q = RolloutQueue(
            eng, iter([[1 + i % 7, 2, 3] for i in range(100)]), groups_per_batch=2,
            samples_per_prompt=2, sampling=sampling, max_staleness=2, mode="alternate",
            oversample=2.0, partial_rollout=True, seed=3,
            multi_turn=multi(env, max_turns=3, max_turn_tokens=6),
        )  # fmt: skip
        q.start()
        for step in range(5):
            named = [(hf_name(n), p.detach()) for n, p in nets[step].named_parameters()]
            q.publish([named], version=step)
            qb = q.get_batch(step)
            b = qb.batch
            for version in b.versions[b.versions >= 0].unique().tolist():
                with torch.no_grad():
                    lp = token_logprobs(
                        nets[version], b.input_ids, attention_mask=b.attention_mask,
                        position_ids=b.position_ids, start=b.prompt_len,
                    )  # fmt: skip
                sel = b.versions == version
                assert (lp[sel] - b.rollout_logprobs[sel]).abs().max() <= 1e-4
            for sample in qb.samples:
                c = sample.completion
                turns = model_turns(c.versions)
                seen = env.states[sample_seed(3, sample.sample_index)]["turns"]
                assert seen == [[c.token_ids[i] for i in t] for t in turns]
                cut_turns += sum(len({c.versions[i] for i in t}) > 1 for t in turns)
        q.close()
    finally:
        eng.shutdown()
        torch.set_num_threads(before)
    print(f"turns cut and continued under the next weights: {cut_turns}")
    assert cut_turns > 0, "no turn was cut and continued under the next weights"


class QwenLikeTokenizer:
    """A character tokenizer with two special tokens and a Qwen-style chat template:
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message (``drop_past`` empties the
    contents of assistant messages before the last user-side one, as templates that drop
    ``<think>`` text do: not append-only)."""

    specials = ("<|im_start|>", "<|im_end|>")
    name_or_path = "toy-qwen"
    eos_id = 1

    def __init__(self, drop_past: bool = False) -> None:
        self.chat_template = "qwen-like"
        self.drop_past = drop_past

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            sp = next((k for k, s in enumerate(self.specials) if text.startswith(s, i)), None)
            if sp is not None:
                ids.append(sp)
                i += len(self.specials[sp])
            else:
                ids.append(2 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids, *, skip_special_tokens=True):
        out = []
        for t in ids:
            if t < 2:
                out.append("" if skip_special_tokens else self.specials[t])
            else:
                out.append(chr(t - 2))
        return "".join(out)

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        text = ""
        for k, m in enumerate(messages):
            content = m["content"]
            if self.drop_past and m["role"] == "assistant" and k < len(messages) - 1:
                content = ""
            text += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_observation_encoder_follows_the_chat_template_and_appends():
    tok = QwenLikeTokenizer()
    enc = observation_encoder(tok)
    # a conversation as the queue builds it: the model's turn ends at <|im_end|> (sampled)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+2?"}]))
    turn = tok.encode("<calc>2+2</calc><|im_end|>")
    obs = enc("4", turn[-1])
    assert obs == tok.encode("\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n")
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<calc>2+2</calc>"},
         {"role": "tool", "content": "4"}]
    )  # fmt: skip
    assert prompt + turn + obs == tok.encode(rendered)  # token in: the context the template renders
    # a turn cut before its end-of-turn token gets it as an observation token
    assert enc("4", tok.encode(">")[0]) == [1, *obs]
    with pytest.raises(ValueError, match="chat template of toy-qwen is not append-only"):
        observation_encoder(QwenLikeTokenizer(drop_past=True))("4", 1)


def test_built_in_environments_score_as_documented():
    from minippo.data.prompts import PromptExample
    from minippo.data.tasks import Calculator, RetryWithFeedback
    from minippo.data.tasks.multi_turn import calculate
    from minippo.env import Turn

    def turn(i, text):
        return Turn(i, [], text, "stop", False)

    retry, row = RetryWithFeedback(retry_reward=0.9), PromptExample(0, (1,), "301=", "103")
    st = retry.reset(row, 0)
    assert retry.step(st, turn(0, "103")) == StepResult(reward=1.0)  # right at once: ends
    assert retry.step(st, turn(0, "100")) == StepResult(observation=":103=", reward=0.0)
    assert retry.step(st, turn(1, "133")).reward == pytest.approx(0.9 * 2 / 3)
    calc, row = Calculator(call_reward=0.2), PromptExample(0, (1,), "3+4=", "7")
    st = calc.reset(row, 0)
    assert calc.step(st, turn(0, "7")).reward == 1.0  # a right answer without the tool
    st = calc.reset(row, 0)
    assert calc.step(st, turn(0, "x(")).observation == "7"  # the tag calls the tool
    assert calc.step(st, turn(1, "7")).reward == 1.0
    assert calc.step(st, turn(1, "5")).reward == pytest.approx(0.2)
    assert calculate("12*3=") == 36 and calculate("9-4") == 5
    with pytest.raises(ValueError, match="the calculator reads"):
        calculate("1/0")
