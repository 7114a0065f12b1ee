"""What the real SGLang engine does that a stand-in would have to imitate, through SGLangEngine.

Each test here shows one behaviour of sglang 0.5.23 (docs/sglang_backend.md, "Verified on the real
engine") and the backend's answer to it: aborts in the step that finishes a sample, the context
limits, the logging reset of ``Engine()``, an engine death, and the alternating queue (the GPU
schedule) driving the real engine with partial rollouts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

import minippo.engine.sglang_engine as backend
from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine.sglang_engine import SGLangEngine
from minippo.models import Transformer, hf_name, init_weights
from minippo.training.rollout_queue import RolloutQueue
from tests.engine_suite import check_completion, one_torch_thread  # noqa: F401 (autouse)
from tests.sglang_cpu.conftest import ARGS, next_base_port

pytestmark = pytest.mark.sglang_cpu

CONTEXT = 256  # the engine's context_length in this module
_MODELS: dict[int, Transformer] = {}


def weights(version: int):
    if version not in _MODELS:
        _MODELS[version] = init_weights(Transformer(ARGS), seed=9000 + version, std=0.1).eval()
    return [[(hf_name(n), p.detach()) for n, p in _MODELS[version].named_parameters()]]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def logged():
    """A handler on the root logger from before the engine starts (as ``minippo run`` sets one)."""
    handler = _Records()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


@pytest.fixture(scope="module")
def engine(model_path, logged):
    eng = SGLangEngine(
        model_path,
        device="cpu",
        dtype="float32",
        model_args=ARGS,
        context_length=CONTEXT,
        base_port=next_base_port(),
        call_timeout_s=120.0,
    )
    eng.publish_weights(weights(0), version=0)
    yield eng
    eng.shutdown()


def test_the_trainers_warnings_still_reach_its_handlers_after_engine_start(engine, logged):
    """``Engine()`` runs ``logging.basicConfig(level=ERROR, force=True)`` in this process; the
    backend puts the process's logging back, so a warning (a skipped step, the LR horizon on
    resume) still reaches the handler set up before the engine started."""
    logging.getLogger("minippo.training.nan_guard").warning("a warning after the engine started")
    assert "a warning after the engine started" in logged.messages


def test_an_abort_in_the_step_that_finishes_a_sample_is_labelled_finished(engine, monkeypatch):
    """SGLang still runs one decode step for a running request it aborts, and labels it "abort"
    even when that token is a stop id or the last of ``max_new_tokens``. The backend labels such
    a response as the finished sample it is ("stop" / "length"), so a rollout is never continued
    past its end. The stop comes right after the group of one short request completes, while a
    few dozen others run with a quarter of the vocabulary as stop ids."""
    settled = []
    real = backend.settled_finish_reason

    def recording(reason, token_ids, params, eos_ids=()):
        out = real(reason, token_ids, params, eos_ids)
        settled.append((reason, out))
        return out

    monkeypatch.setattr(backend, "settled_finish_reason", recording)
    stops = tuple(range(0, ARGS.vocab_size, 4))
    for round_ in range(8):
        short = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=1), f"s{round_}", "short")
        others = [
            GenerateRequest(
                [1 + i % 9, 2, 3],
                SamplingParams(max_new_tokens=2 + i % 3, stop_token_ids=stops),
                f"o{round_}-{i}",
                f"g{i}",
            )
            for i in range(48)
        ]
        requests = [short, *others]
        outs = list(engine.stream(requests, until_groups=1))
        by_id = {r.request_id: r for r in requests}
        for c in outs:
            check_completion(c, by_id[c.request_id], ARGS.vocab_size)
        if any(before == "abort" and after != "abort" for before, after in settled):
            break
    relabelled = sum(before == "abort" and after != "abort" for before, after in settled)
    assert relabelled > 0, "no abort landed in a finishing step: the case was not exercised"


def test_a_request_may_fill_the_context(engine):
    """SGLang's limits stop short of its context (it caps max_new at context - 2 - prompt and
    rejects prompts of context - 6 tokens or more): the backend gives SGLang CONTEXT_SLACK more,
    so any request with prompt + max_new_tokens <= context_length runs to its length."""
    cases = [(CONTEXT - 1, 1), (CONTEXT - 5, 5), (CONTEXT - 40, 40)]
    requests = [
        GenerateRequest([1 + i % 50 for i in range(p)], SamplingParams(max_new_tokens=n), f"c{p}")
        for p, n in cases
    ]
    outs = engine.generate(requests)
    for c, r, (_, n) in zip(outs, requests, cases):
        check_completion(c, r, ARGS.vocab_size)
        assert (len(c.token_ids), c.finish_reason) == (n, "length")
    with pytest.raises(ValueError, match="exceeds the engine's context length"):
        engine.generate([GenerateRequest([1] * CONTEXT, SamplingParams(max_new_tokens=1), "x")])


def test_the_alternate_queue_never_continues_a_sample_past_its_end(engine):
    """The GPU schedule on the real engine: over-provisioned groups (oversample 2), partial
    rollouts continued under newer weights, a 200-token cap and 1 token id in 32 a stop id. Every
    trained sample ends at its first stop id or at the cap, its tokens within the staleness
    bound, and some span two versions (the stop really cuts running samples)."""
    stops = tuple(range(0, ARGS.vocab_size, 32))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=stops)

    def prompts():
        i = 0
        while True:
            yield [1 + i % 7, 2 + i % 5, 3]
            i += 1

    queue = RolloutQueue(
        engine,
        prompts(),
        groups_per_batch=4,
        samples_per_prompt=2,
        sampling=sampling,
        max_staleness=1,
        partial_rollout=True,
        mode="alternate",
        oversample=2.0,
    )
    queue.start()
    spans = 0
    try:
        for step in range(8):  # the engine holds version 0: the steps publish versions 0..7
            queue.publish(weights(10 + step), version=step)
            batch = queue.get_batch(step)
            for sample in batch.samples:
                c = sample.completion
                assert c.finish_reason in ("stop", "length")
                assert len(c.token_ids) <= sampling.max_new_tokens
                assert not set(stops) & set(c.token_ids[:-1]), "continued past a stop id"
                if c.finish_reason == "stop":
                    assert c.token_ids[-1] in stops
                assert min(c.versions) >= step - 1 and max(c.versions) <= step
            spans += int(batch.metrics["rollout/multi_version_fraction"] * 8)
    finally:
        queue.close()
    assert spans > 0, "no trained sample spans two versions: nothing was carried"


DEATH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    from minippo.engine.sglang_engine import SGLangEngine, SGLangEngineDied
    from minippo.models import qwen3_tiny

    def main():
        eng = SGLangEngine(None, model_args=qwen3_tiny(), device="cpu", dtype="float32",
                           base_port=int(sys.argv[1]))
        children = [p.pid for p in eng._engine_procs]  # its scheduler and detokenizer
        try:  # SGLang's memory release calls torch.cuda.synchronize: fatal in its scheduler
            eng._call(eng._tm.release_memory_occupation(
                obj=eng._api.ReleaseMemoryOccupationReqInput(tags=None), request=None), "sleep")
        except SGLangEngineDied as e:
            died = type(e).__name__
        else:
            died = None
        try:
            eng.generate([])
        except SGLangEngineDied:
            refused = True
        eng.shutdown()
        alive = [pid for pid in children if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        print("RESULT " + json.dumps({"died": died, "refused": refused, "children": children,
                                      "alive": alive}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_an_engine_death_is_one_line_and_leaves_no_process(tmp_path):
    """A scheduler that dies (here: SGLang's memory release, which calls CUDA) makes the call in
    progress raise SGLangEngineDied, prints one line naming the rank and the call, refuses every
    later call, and shutdown leaves none of the engine's processes (scheduler, detokenizer)
    behind."""
    script = tmp_path / "death.py"
    script.write_text(DEATH_SCRIPT)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(next_base_port())],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["died"] == "SGLangEngineDied" and result["refused"]
    assert result["children"] and not result["alive"], result
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[minippo]")]
    assert len(ours) == 1, ours
    assert "the SGLang engine died" in ours[0] and "sleep" in ours[0]


@pytest.mark.parametrize(
    "feature, reason",
    [
        ("sleep / wake (release_memory_occupation)", "SGLang's release calls torch.cuda and "
         "its memory saver needs libcuda: tests/gpu/test_sglang_gpu.py on a CUDA machine"),
        ("seeded sampling", "SGLang honours request seeds only with deterministic inference, "
         "which refuses the torch_native attention of its CPU path"),
        ("CUDA IPC weight payloads", "a CPU engine receives its buckets as shared-memory "
         "tensors; the IPC path runs in scripts/gpu_rehearsal.py and tests/gpu/"),
    ],
)  # fmt: skip
def test_what_only_a_gpu_can_show(feature, reason):
    pytest.skip(f"{feature}: {reason}")


def test_sleep_mode_is_refused_on_the_cpu(model_path):
    with pytest.raises(ValueError, match="memory_mode=sleep needs device=cuda"):
        SGLangEngine(model_path, device="cpu", memory_mode="sleep", model_args=ARGS)


SHUTDOWN_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, time
    from multiprocessing import resource_tracker
    import psutil
    from minippo.engine.sglang_engine import SGLangEngine
    from minippo.models import qwen3_tiny

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def main():
        ctx = multiprocessing.get_context("spawn")
        ctx.Lock()  # a semaphore: the resource tracker runs from here on
        tracker = resource_tracker._resource_tracker._pid
        bystander = ctx.Process(target=time.sleep, args=(600,), daemon=True)
        bystander.start()
        eng = SGLangEngine(None, model_args=qwen3_tiny(), device="cpu", dtype="float32",
                           base_port=int(sys.argv[1]))
        engine_pids = [p.pid for p in eng._engine_procs]  # its scheduler and detokenizer
        before = [running(pid) for pid in engine_pids]
        eng.shutdown()
        print("RESULT " + json.dumps({
            "engine": engine_pids, "before": before,
            "after": [running(pid) for pid in engine_pids],
            "bystander": bystander.is_alive(), "tracker": running(tracker)}), flush=True)
        bystander.kill()
        bystander.join(30)

    if __name__ == "__main__":
        main()
    """
)


def test_shutdown_ends_only_the_engines_processes(tmp_path):
    """SGLang's Engine.shutdown (also run at interpreter exit) would SIGKILL every child of this
    process; the backend ends only the engine's own: a worker started before the engine and
    multiprocessing's resource tracker outlive it, and the process exits without the traceback
    that a killed resource tracker makes Python print. (A process of its own: one SGLang engine
    per process, and the module's engine is alive.)"""
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(next_base_port())],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["engine"] and all(got["before"]) and not any(got["after"]), got
    assert got["bystander"], "the engine's shutdown killed a process it did not start"
    assert got["tracker"], "the engine's shutdown killed multiprocessing's resource tracker"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
