"""SGLangEngine on CPU, against a recording stand-in of SGLang 0.5.23's Engine.

The stand-in (``FakeSGLang``) behaves like the documented API, including the details the backend
depends on: ``Engine(**server_args)`` reads ``config.json`` from ``model_path`` and, with
``load_format="dummy"``, starts from random weights; ``async_generate`` returns the documented dict
(``output_ids``; ``meta_info`` with ``finish_reason {"type"}``, ``weight_version``,
``weight_versions`` spans and ``output_token_logprobs`` as ``(logprob, token_id, None)``) and
samples from a real tiny Qwen3 (so the logprob semantics are real: ``log_softmax(logits / T)``
after SGLang's greedy rewrite T < 1e-6 -> T = 1, top_k = 1); the tokenizer manager's pause / continue
/ weight-update / memory coroutines and the synchronous ``abort_request`` follow the scheduler's
rules (update_weights_from_tensor only inside a begin/end session, waits for running requests
unless paused; release needs an idle engine; released weights are garbage until pushed again;
generating with a released KV cache fails; a version change records (old version, tokens so far)
for every live request; aborting a retracted request returns what was streamed so far, a
multiple of 50 tokens; ``abort_request(rid=...)`` is sent at most once per rid and only for a
rid the tokenizer manager knows (an empty one is ignored), and the scheduler then aborts every
request it holds whose rid starts with it, a request still held in the tokenizer manager by a
pause not included). Every call is recorded, so the tests assert the exact call sequence.

It is as unforgiving as 0.5.23 where the backend's correctness depends on it:
    * fatal scheduler errors are process death, not exceptions: a wrong weight shape, pushing into
      released weights, releasing while not fully idle, resuming a tag never released, generating
      with a released KV cache, or an injected engine OOM make the stand-in log "Scheduler hit an
      exception" and send SIGQUIT to this process, then never answer again; the SIGQUIT handler
      installed by ``Engine()`` is SGLang's (SIGKILL this process) unless ``custom_sigquit_handler``
      is given. Tests that could reach such a path on the old code run in a child process
      (``run_scenario``);
    * an unknown weight name is skipped with a warning (the model keeps its dummy weights);
    * seeds are ignored unless ``enable_deterministic_inference``; in that mode a request without
      ``sampling_seed`` uses 42;
    * right after the last request finishes the scheduler is not yet fully idle for one loop
      iteration: the next ``flush_cache`` fails and a release there is fatal;
    * the scheduler sees one GPU (index 0): a CUDA IPC handle that carries the producer's device
      index instead of the GPU's UUID (no ``monkey_patch_torch_reductions``) from a rank whose
      local index is not 0 is fatal;
    * the environment the scheduler inherits is recorded (``spawn_env``);
    * as seen on the real engine (the ``sglang_cpu`` lane): a running request that is aborted
      still samples one more token and comes back labelled "abort" even when that token is a
      stop id or its last; SGLang's context limits (max_new capped at ``context - 2 - prompt``,
      prompts of ``context - 6`` tokens or more refused with a ValueError from
      ``async_generate``); ``Engine()`` resets this process's logging
      (``logging.basicConfig(level=ERROR, force=True)``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import minippo.engine._sglang_process as process_care
import minippo.engine.sglang_engine as backend
from minippo.config import instantiate
from minippo.engine import GenerateRequest, SamplingParams
from minippo.engine.sglang_engine import (
    SGLangEngine,
    completion_from_output,
    engine_ports,
    sglang_sampling_params,
    token_versions,
)
from minippo.models import Transformer, init_weights, native_name, qwen3_tiny
from minippo.models.hf_checkpoint import hf_config_from_model_args, model_args_from_hf_config
from minippo.parallel import full_tensor_buckets
from tests.engine_suite import (
    EngineHarness,
    EngineProtocolSuite,
    join,
    one_torch_thread,  # noqa: F401 (autouse: one torch thread for this module)
    reference_logprobs_of,
    req,
    run_in_thread,
)
from tests.sglang_api import SERVER_ARG_KEYS

ARGS = qwen3_tiny()
REAL_PORT_CHECK = backend.check_port_free
EOS = 63  # the stand-in model's EOS id (config.json "eos_token_id")
FORCE_STREAM_INTERVAL = 50  # SGLANG_FORCE_STREAM_INTERVAL's default in 0.5.23

# ----------------------------------------------------------------------------------------------
# The stand-in


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list | None = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list | None = None


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class FakeSerializer:
    """Stands for MultiprocessingSerializer: bytes in, the same objects out (in-process). Records
    whether SGLang's producer-side reduction patch (device UUID instead of index) was applied."""

    payloads: dict[bytes, object] = {}  # noqa: RUF012
    _ids = itertools.count()
    patched = False  # process-wide, as SGLang's monkey_patch_torch_reductions

    @staticmethod
    def serialize(obj, output_str=False):
        key = b"ipc-payload-%d" % next(FakeSerializer._ids)
        FakeSerializer.payloads[key] = (obj, FakeSerializer.patched)
        return key

    @staticmethod
    def deserialize(data):
        return FakeSerializer.payloads.pop(data)


SERIALIZER: Any = FakeSerializer  # what the scheduler deserialises payloads with


def monkey_patch_torch_reductions():
    """Idempotent and process-wide, as SGLang's: the first application is recorded."""
    if not FakeSerializer.patched and FakeEngine.instances:
        FakeEngine.instances[-1].log.append(("monkey_patch_torch_reductions",))
    FakeSerializer.patched = True


def sglang_launch_sigquit_handler(signum, frame):
    """SGLang's launch-phase handler: kill_process_tree(os.getpid()) ends with SIGKILL of self."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    sp: dict
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, n tokens)
    dispatched: bool = False
    abort_sent: bool = False  # the tokenizer manager's ReqState.abort_sent
    retracted: bool = False
    abort: bool = False
    finish: dict | None = None


SAMPLING_KEYS = {  # sglang.srt.sampling.sampling_params.SamplingParams API fields (subset)
    "max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "ignore_eos", "sampling_seed", "n", "stop",
}  # fmt: skip


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine) -> None:
        self.e = engine
        self.is_pause = False
        self.session = False

    async def pause_generation(self, obj):
        self.e.seen(obj, "PauseGenerationReqInput")
        e = self.e
        await e.alive("pause_generation")
        counts = {r.rid: len(r.out) for r in e.live.values() if r.dispatched}
        e.log.append(("pause_generation", obj.mode, counts))
        self.is_pause = True
        e.sched_paused = True
        if obj.mode == "retract":
            for r in e.live.values():
                if r.dispatched:
                    r.retracted = True

    async def continue_generation(self, obj):
        self.e.seen(obj, "ContinueGenerationReqInput")
        await self.e.alive()
        self.e.log.append(("continue_generation", obj.torch_empty_cache))
        self.is_pause = False
        self.e.sched_paused = False

    def abort_request(self, rid: str = "", abort_all: bool = False):
        e = self.e
        e.log.append(("abort_request", rid, abort_all))
        if not abort_all:  # the tokenizer manager: by the rid's state, at most once per rid
            state = e.live.get(rid) if rid else None  # an empty rid is ignored
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
        # the scheduler: every request it holds whose rid starts with ``rid``
        for r in list(e.live.values()):
            if (abort_all or r.rid.startswith(rid)) and r.dispatched and r.finish is None:
                if r.retracted:  # in the waiting queue: what was streamed so far
                    keep = (len(r.out) // FORCE_STREAM_INTERVAL) * FORCE_STREAM_INTERVAL
                    del r.out[keep:], r.logprobs[keep:]
                    r.events = [(v, min(n, keep)) for v, n in r.events if min(n, keep) > 0]
                    r.finish = {"type": "abort", "message": "Abort in waiting queue"}
                else:  # running: finishes at its next step with everything
                    r.abort = True

    async def begin_weight_update(self, obj, request=None):
        self.e.seen(obj, "BeginWeightUpdateReqInput")
        await self.e.alive()
        self.e.log.append(("begin_weight_update",))
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self.e.seen(obj, "EndWeightUpdateReqInput")
        await self.e.alive()
        self.e.log.append(("end_weight_update",))
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request=None):
        self.e.seen(obj, "UpdateWeightsFromTensorReqInput")
        e = self.e
        await e.alive()
        if not self.is_pause:  # the model_update_lock writer: waits for running requests
            await e.wait_until(lambda: not e.live)
        (payload,) = obj.serialized_named_tensors  # one per TP rank
        if SERIALIZER is FakeSerializer:
            named, patched = FakeSerializer.deserialize(payload)
        else:  # SGLang's own (SafeUnpickler); CPU tensors cannot carry the CUDA-only patch
            named, patched = SERIALIZER.deserialize(payload), FakeSerializer.patched
        e.log.append(
            (
                "update_weights_from_tensor",
                [n for n, _ in named],
                {t.dtype for _, t in named},
                sum(t.numel() * t.element_size() for _, t in named),
                obj.load_format,
                obj.flush_cache,
                obj.weight_version,
                patched,
            )
        )
        if e.fail_bucket is not None and e.updates_seen == e.fail_bucket:
            e.updates_seen += 1
            return False, "injected failure"
        e.updates_seen += 1
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() ..."
        if not patched and e.kwargs["base_gpu_id"] != 0:
            await e.die(f"CUDA error: invalid device ordinal {e.kwargs['base_gpu_id']}")
        if "weights" in e.released:
            await e.die("CUDA error: an illegal memory access (weights memory is released)")
        params = dict(e.model.named_parameters())
        with torch.no_grad():
            for name, t in named:  # Qwen3 load_weights
                try:
                    p = params[native_name(name)]
                except KeyError:
                    e.warnings.append(f"Parameter {name} not found in params_dict")
                    continue
                if p.shape != t.shape:
                    await e.die(f"AssertionError: {name}: {tuple(p.shape)} != {tuple(t.shape)}")
                p.copy_(t.float())
        return True, "Success"

    async def flush_cache(self, timeout_s=None):
        e = self.e
        await e.alive()
        ok = e.fully_idle()  # retracted (paused) requests in the waiting queue do not count
        e.log.append(("flush_cache", ok))
        return FlushCacheReqOutput(success=ok)

    async def update_weight_version(self, obj):
        self.e.seen(obj, "UpdateWeightVersionReqInput")
        e = self.e
        await e.alive()
        e.log.append(("update_weight_version", obj.new_version, obj.abort_all_requests))
        if obj.new_version != e.version:
            for r in e.live.values():
                if r.out:
                    r.events.append((e.version, len(r.out)))
            e.version = obj.new_version

    async def release_memory_occupation(self, obj, request=None):
        e = self.e
        e.seen(obj, "ReleaseMemoryOccupationReqInput")
        await e.alive()
        e.log.append(("release_memory_occupation", obj.tags))
        if not e.fully_idle():
            await e.die("AssertionError: release_memory_occupation should be called only when idle")
        tags = obj.tags or ["weights", "kv_cache", "cuda_graph"]
        e.released |= set(tags)
        if "weights" in tags:
            e.backup = {n: p.detach().clone() for n, p in e.model.named_parameters()}
            with torch.no_grad():
                for p in e.model.parameters():
                    p.fill_(float("nan"))  # the memory is gone: contents undefined

    async def resume_memory_occupation(self, obj, request=None):
        e = self.e
        e.seen(obj, "ResumeMemoryOccupationReqInput")
        await e.alive()
        e.log.append(("resume_memory_occupation", obj.tags))
        if e.fatal_on == "resume_memory_occupation":
            await e.die("torch_memory_saver: cuMemCreate failed: out of memory")
        tags = obj.tags or ["weights", "kv_cache", "cuda_graph"]
        for tag in tags:
            if tag not in e.released:
                await e.die(f"KeyError: {tag!r} (resume of a tag that was never released)")
        e.released -= set(tags)
        if "weights" in tags and e.kwargs["enable_weights_cpu_backup"]:
            with torch.no_grad():
                for n, p in e.model.named_parameters():
                    p.copy_(e.backup[n])


class FakeEngine:
    """Stands for sglang.srt.entrypoints.engine.Engine (see the module docstring)."""

    instances: list[FakeEngine] = []  # noqa: RUF012

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.log: list[tuple] = [("Engine", kwargs)]
        # configure_logger(server_args) in the trainer's process
        logging.basicConfig(level=logging.ERROR, force=True)
        with open(Path(kwargs["model_path"]) / "config.json") as f:
            cfg = json.load(f)
        self.eos = {int(cfg["eos_token_id"])} if "eos_token_id" in cfg else set()
        self.model = Transformer(model_args_from_hf_config(cfg)).eval()
        assert kwargs["load_format"] == "dummy"
        init_weights(self.model, seed=kwargs["random_seed"] + 12345, std=0.1)
        self.version = kwargs["weight_version"]
        self.deterministic = kwargs["enable_deterministic_inference"]
        self.shared_gen = torch.Generator().manual_seed(kwargs["random_seed"])
        self.spawn_env = dict(os.environ)  # what the scheduler process would inherit
        # SGLang's _set_envs_and_config: the SIGQUIT handler of this process (main thread only)
        if threading.current_thread() is threading.main_thread():
            handler = kwargs.get("custom_sigquit_handler") or sglang_launch_sigquit_handler
            signal.signal(signal.SIGQUIT, handler)
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.loop = asyncio.new_event_loop()
        self.live: dict[str, _Req] = {}
        self.sched_paused = False
        self.released: set[str] = set()
        self.backup: dict = {}
        self.step_s = 0.0005
        self.fail_bucket: int | None = None
        self.updates_seen = 0
        self.closed = False
        self.dead = False
        self.idle_lag = 0  # loop iterations the scheduler still holds its last batch
        self.fatal_on: str | None = None  # inject a fatal error into this call
        self.oom_at_step: int | None = None  # inject an engine OOM at this decode step
        self.hang_on: set[str] = set()  # tokenizer-manager calls that never answer
        self.sampling: dict[str, dict] = {}  # rid -> the sampling params received
        self.api = CURRENT_API[0]
        self.structs: set[str] = set()
        self.steps = 0
        self.warnings: list[str] = []
        FakeEngine.instances.append(self)

    def seen(self, obj, kind: str) -> None:
        """The request struct a call received must be SGLang's ``kind`` (stand-in or real)."""
        assert type(obj).__name__ == kind, f"expected {kind}, got {type(obj)}"
        assert type(obj) is getattr(self.api, kind), f"{kind} is not the api's class"
        self.structs.add(f"{type(obj).__module__}.{kind}")

    async def die(self, reason: str):
        """A scheduler exception: log it, SIGQUIT the parent (this process), never answer again."""
        tb = "".join(traceback.format_stack(limit=4))
        print(f"Scheduler hit an exception: Traceback (most recent call last):\n{tb}{reason}",
              file=sys.stderr, flush=True)  # fmt: skip
        self.dead = True
        self.log.append(("scheduler died", reason))
        os.kill(os.getpid(), signal.SIGQUIT)
        await asyncio.get_running_loop().create_future()  # never resolves

    async def alive(self, call: str = ""):
        """A dead scheduler never answers; nor does a call in ``hang_on`` (a stuck scheduler)."""
        if self.dead or call in self.hang_on:
            await asyncio.get_running_loop().create_future()

    def fully_idle(self) -> bool:
        """Scheduler.is_fully_idle: no running request, and the overlap loop's last batch gone."""
        if any(r.dispatched and not r.retracted for r in self.live.values()):
            return False
        if self.idle_lag:
            self.idle_lag -= 1
            return False
        return True

    @staticmethod
    async def wait_until(pred):
        """Poll (the scheduler's busy loop, in miniature)."""
        while not pred():
            await asyncio.sleep(0.0005)

    def progress(self) -> dict[str, int]:
        return {r.rid: len(r.out) for r in list(self.live.values())}

    async def async_generate(
        self, input_ids=None, sampling_params=None, return_logprob=False, rid=None, **unused
    ):
        assert not unused, unused
        assert isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], int)
        assert return_logprob is True and isinstance(rid, str)
        unknown = set(sampling_params) - SAMPLING_KEYS
        assert not unknown, f"not SGLang sampling params: {unknown}"
        sp = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 128,
            **sampling_params,
        }
        if 0 <= sp["temperature"] < 1e-6:  # SGLang's greedy rewrite
            sp["temperature"], sp["top_k"] = 1.0, 1
        context = self.kwargs["context_length"] or ARGS.max_seq_len
        max_req_len = context - 1  # tp_worker: max_req_len = context_len - 1
        if len(input_ids) >= max_req_len - 5:  # managers/utils.py: an abort, raised by the TM
            raise ValueError(
                f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length "
                f"({max_req_len - 5} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        sp["max_new_tokens"] = min(sp["max_new_tokens"], max_req_len - len(input_ids) - 1)
        if self.deterministic:  # sampling_batch_info: the request's seed, or 42
            gen = torch.Generator().manual_seed(sp.get("sampling_seed", 42))
        else:  # the seed is dropped: one engine-wide generator, order-dependent
            gen = self.shared_gen
        r = _Req(rid, list(input_ids), sp, gen)
        self.sampling[rid] = dict(sampling_params)
        self.live[rid] = r
        tm = self.tokenizer_manager
        await self.alive()
        try:
            await self.wait_until(lambda: not tm.is_pause)  # the tokenizer manager's pause gate
            r.dispatched = True
            self.log.append(("dispatch", rid))
            while r.finish is None:
                await self.wait_until(lambda: not self.sched_paused or r.finish is not None)
                if r.finish is not None:
                    break
                r.retracted = False
                if r.abort:  # FINISH_ABORT is set, and one more decode step still runs for it;
                    await self._step(r)  # the abort wins over its stop / length
                    r.finish = {"type": "abort", "message": "Aborted"}
                    break
                await self._step(r)
                if r.finish is None:  # a finished request returns at once
                    await asyncio.sleep(self.step_s)
        finally:
            del self.live[rid]
            self.idle_lag = 1
        self.log.append(("finish", rid, r.finish["type"], len(r.out)))
        n = len(r.out)
        spans = []
        for v, end in [*r.events, (self.version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and v == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": v, "start": spans[-1]["end"] if spans else 0, "end": end})
        return {
            "output_ids": list(r.out),
            "meta_info": {
                "id": rid,
                "finish_reason": r.finish,
                "prompt_tokens": len(r.prompt),
                "weight_version": self.version,
                "completion_tokens": n,
                "weight_versions": spans,
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(r.logprobs, r.out)],
            },
        }

    async def _step(self, r: _Req) -> None:
        self.steps += 1
        if self.released & {"kv_cache", "cuda_graph"}:
            await self.die("CUDA error: illegal memory access (KV cache released)")
        if self.oom_at_step is not None and self.steps >= self.oom_at_step:
            await self.die("torch.OutOfMemoryError: CUDA out of memory (sampling)")
        with torch.no_grad():
            tok, logprob = self._sample(r)
        r.out.append(tok)
        r.logprobs.append(logprob)
        stops = (
            set() if r.sp.get("ignore_eos") else set(r.sp.get("stop_token_ids") or ()) | self.eos
        )
        if tok in stops:
            r.finish = {"type": "stop", "matched": tok}
        elif len(r.out) >= r.sp["max_new_tokens"]:
            r.finish = {"type": "length", "length": len(r.out)}

    def _sample(self, r: _Req) -> tuple[int, float]:
        logits = self.model(torch.tensor([r.prompt + r.out]))[0, -1].float()
        z = logits / r.sp["temperature"]
        logprobs = torch.log_softmax(z, -1)  # reported: full vocabulary, not renormalised
        keep = z.clone()
        k = r.sp["top_k"]
        if 0 < k < keep.numel():
            keep[keep < keep.topk(k).values[-1]] = -math.inf
        if r.sp["top_p"] < 1.0:
            probs = torch.softmax(keep, -1)
            order = probs.argsort(descending=True)
            cum = probs[order].cumsum(0)
            drop = order[(cum - probs[order]) > r.sp["top_p"]]
            keep[drop] = -math.inf
        tok = int(torch.multinomial(torch.softmax(keep, -1), 1, generator=r.gen))
        return tok, float(logprobs[tok])

    def shutdown(self):
        self.log.append(("shutdown",))
        self.closed = True


CURRENT_API: list[SimpleNamespace] = []  # the api the backend loaded last (for FakeEngine)


def fake_api() -> SimpleNamespace:
    CURRENT_API[:] = [_fake_api()]
    return CURRENT_API[0]


def _fake_api() -> SimpleNamespace:
    return SimpleNamespace(
        Engine=FakeEngine,
        MultiprocessingSerializer=FakeSerializer,
        monkey_patch_torch_reductions=monkey_patch_torch_reductions,
        PauseGenerationReqInput=PauseGenerationReqInput,
        ContinueGenerationReqInput=ContinueGenerationReqInput,
        BeginWeightUpdateReqInput=BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput=EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
        UpdateWeightVersionReqInput=UpdateWeightVersionReqInput,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
    )


# ----------------------------------------------------------------------------------------------
# Trainer side: models per version, HF buckets, reference logprobs

_MODELS: dict[int, Transformer] = {}


def model_of(version: int) -> Transformer:
    if version not in _MODELS:
        _MODELS[version] = init_weights(Transformer(ARGS), seed=2000 + version, std=0.1).eval()
    return _MODELS[version]


def weights(version: int, bucket_bytes: int = 40_000):
    return list(full_tensor_buckets(model_of(version), bucket_bytes=bucket_bytes))


reference_logprobs = reference_logprobs_of(model_of)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    cfg = hf_config_from_model_args(ARGS)
    cfg["eos_token_id"] = EOS
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture
def fake(monkeypatch):
    """Use the stand-in; record the IPC-collect hook calls into the engine's log."""
    install_stand_in(monkeypatch.setattr)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "SGLANG_RETURN_ORIGINAL_LOGPROB"):
        monkeypatch.delenv(var, raising=False)
    # a death in this process must fail the test, not end pytest 30 s later
    monkeypatch.setattr(process_care, "DEATH_EXIT_GRACE_S", 3600.0)
    old = signal.getsignal(signal.SIGQUIT)
    yield FakeEngine.instances
    signal.signal(signal.SIGQUIT, old)


def install_stand_in(setattr_) -> None:
    """Point the backend at the stand-in; record the trainer-side CUDA hooks into its log."""
    setattr_(backend, "_load_sglang_api", fake_api)
    setattr_(backend, "FLUSH_RETRY_S", 0.001)
    # the stand-in binds no port: a real engine of another process on the default ports must not
    # fail these tests (test_a_port_in_use_is_refused_before_the_engine_starts checks the probe)
    setattr_(backend, "check_port_free", lambda port, **kw: None)
    FakeEngine.instances.clear()
    FakeSerializer.patched = False

    def ipc_collect():
        FakeEngine.instances[-1].log.append(("ipc_collect",))

    def release_cache():
        FakeEngine.instances[-1].log.append(("empty_cache",))

    setattr_(backend, "_cuda_ipc_collect", ipc_collect)
    setattr_(backend, "_cuda_release_cache", release_cache)


def make_engine(model_path, publish_v0=True, **kw) -> SGLangEngine:
    kw = {
        "dtype": "float32",
        "memory_mode": "sleep",
        "context_length": ARGS.max_seq_len,
        "enable_deterministic_inference": True,  # seeds honoured (the protocol suite needs it)
        **kw,
    }
    eng = SGLangEngine(model_path, **kw)
    if publish_v0:
        eng.publish_weights(weights(0), version=0)
    return eng


def calls(fake_engine: FakeEngine, *names: str) -> list[tuple]:
    """The recorded calls (only those named, if names are given), without dispatch/finish."""
    skip = {"dispatch", "finish", "Engine"}
    return [c for c in fake_engine.log if (c[0] in names if names else c[0] not in skip)]


def wait_for(pred, timeout=30.0):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "timed out"
        time.sleep(0.001)


# ----------------------------------------------------------------------------------------------
# The shared protocol suite against the stand-in


class TestSGLangEngineProtocol(EngineProtocolSuite):
    @pytest.fixture
    def harness(self, fake, model_path):
        return EngineHarness(
            # the suite generates after sleep() / wake() without a publish: keep a host copy
            make_engine=lambda: make_engine(model_path, weights_cpu_backup=True),
            vocab_size=ARGS.vocab_size,
            max_seq_len=ARGS.max_seq_len,
            weights=weights,
            reference_logprobs=reference_logprobs,
            logprob_tol=1e-4,
            long_tokens=200,  # ~1 s on the stand-in: still running 50 ms after submission
            exact_stops=False,  # a stream's aborts land at SGLang's next step
        )


# ----------------------------------------------------------------------------------------------
# Exact call sequences


def test_engine_kwargs_one_engine_per_rank(fake, model_path):
    eng = make_engine(
        model_path, publish_v0=False, local_rank=3, base_port=31000, port_stride=10,
        mem_fraction_static=0.35, memory_mode="overlap", dtype="bfloat16", version=4,
    )  # fmt: skip
    kw = fake[-1].kwargs
    assert kw["tp_size"] == 1 and kw["base_gpu_id"] == 3
    assert (kw["port"], kw["nccl_port"]) == (31030, 31031)
    assert kw["skip_tokenizer_init"] is True and kw["load_format"] == "dummy"
    assert kw["mem_fraction_static"] == 0.35 and kw["dtype"] == "bfloat16"
    assert kw["enable_memory_saver"] is False  # overlap mode needs no release/resume
    assert kw["weight_version"] == "4" and eng.version == 4
    assert tuple(kw) == SERVER_ARG_KEYS
    assert eng.dtype == torch.bfloat16
    eng.shutdown()
    eng.shutdown()  # idempotent
    assert calls(fake[-1], "shutdown") == [("shutdown",)]
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate([req([1], "a")])


def test_local_rank_defaults_to_env(fake, model_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    eng = make_engine(model_path, publish_v0=False)
    assert fake[-1].kwargs["base_gpu_id"] == 5
    assert fake[-1].kwargs["port"] == 30000 + 5 * 8
    eng.shutdown()


def test_publish_sequence_buckets_names_dtypes_and_ipc_collect(fake, model_path):
    eng = make_engine(model_path, publish_v0=False, memory_mode="overlap", dtype="bfloat16")
    bucket_bytes = 40_000
    buckets = weights(1, bucket_bytes)
    eng.publish_weights(iter(buckets), version=1)
    seq = calls(fake[-1])
    n = len(buckets)
    assert [c[0] for c in seq] == [
        "begin_weight_update",
        "monkey_patch_torch_reductions",  # before the first payload is serialised
        *["update_weights_from_tensor", "ipc_collect"] * n,
        "ipc_collect",  # once more after the last bucket
        "end_weight_update",
        "flush_cache",
        "update_weight_version",
    ]
    updates = [c for c in seq if c[0] == "update_weights_from_tensor"]
    hf_names = [name for b in buckets for name, _ in b]
    assert [name for u in updates for name in u[1]] == hf_names  # same names, same order
    assert "lm_head.weight" not in hf_names  # tied: skipped
    assert hf_names[0] == "model.embed_tokens.weight"
    for u, b in zip(updates, buckets):
        _, names, dtypes, nbytes, load_format, flush, version, patched = u
        assert patched  # the IPC handles carry the GPU's UUID
        assert dtypes == {torch.bfloat16}  # cast to the engine dtype
        assert nbytes == sum(t.numel() * 2 for _, t in b)
        assert nbytes <= bucket_bytes // 2 or len(names) == 1  # fp32 buckets -> bf16 halves
        assert (load_format, flush, version) == (None, False, None)
    assert seq[-3:] == [
        ("end_weight_update",),
        ("flush_cache", True),
        ("update_weight_version", "1", False),
    ]
    assert eng.version == 1
    # the engine now holds the trainer's weights (bf16-rounded)
    for name, p in fake[-1].model.named_parameters():
        ref = dict(model_of(1).named_parameters())[name]
        assert torch.equal(p, ref.detach().to(torch.bfloat16).float())
    eng.shutdown()


def test_sleep_wake_ordering(fake, model_path):
    eng = make_engine(model_path)  # sleep mode, fp32
    f = fake[-1]
    assert f.kwargs["enable_memory_saver"] is True
    r = req([1, 2, 3], "a", max_new_tokens=4, seed=1)
    eng.generate([r])
    del f.log[:]
    eng.sleep()
    assert calls(f) == [  # a flush proves the scheduler idle (it was not, once), then release all
        ("flush_cache", False),
        ("flush_cache", True),
        ("release_memory_occupation", None),
    ]
    with pytest.raises(RuntimeError, match="sleep"):
        eng.generate([r])
    with pytest.raises(RuntimeError, match="wake"):
        eng.publish_weights(weights(1), version=1)
    eng.wake()  # the trainer's cached CUDA blocks go back to the driver first
    assert calls(f)[-2:] == [("empty_cache",), ("resume_memory_occupation", ["weights"])]
    with pytest.raises(RuntimeError, match="publish_weights"):
        eng.generate([r])  # weights are garbage, KV cache still released
    del f.log[:]
    eng.publish_weights(weights(1), version=1)
    # the KV cache and CUDA graphs stay released: the trainer may offload now
    assert [c[0] for c in calls(f) if c[0] != "ipc_collect"][-4:] == [
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
        "update_weight_version",
    ]
    assert "resume_memory_occupation" not in [c[0] for c in calls(f)]
    assert f.released == {"kv_cache", "cuda_graph"}
    del f.log[:]
    (c,) = eng.generate([r])  # restores them first: empty_cache, resume, then the request
    assert [x for x in f.log if x[0] != "finish"] == [
        ("empty_cache",),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
        ("dispatch", "1#a"),
    ]
    assert c.versions == [1] * 4
    ref = reference_logprobs(1, r.prompt_ids, c.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-4
    eng.generate([r])
    assert len(calls(f, "resume_memory_occupation")) == 1  # once per publish
    # sleeping again right after wake() (no publish) releases only the weights
    eng.sleep()
    eng.wake()
    eng.sleep()
    assert calls(f, "release_memory_occupation")[-1] == ("release_memory_occupation", ["weights"])
    eng.shutdown()


def test_sleep_mode_sequence_restores_kv_at_the_first_generation(fake, model_path):
    """sleep -> wake -> publish -> [trainer offloads] -> generate / stream -> sleep: the exact
    calls; the KV cache comes back only when a request is about to be admitted, once, after the
    trainer's cached CUDA blocks went back to the driver."""
    eng = make_engine(model_path)
    f = fake[-1]
    r = req([1, 2, 3], "a", max_new_tokens=3, seed=1)
    eng.generate([r])
    for version, first in ((1, "generate"), (2, "stream")):
        del f.log[:]
        eng.sleep()
        eng.wake()
        eng.publish_weights(weights(version), version=version)
        names = [
            c[0] for c in calls(f) if c[0] not in ("ipc_collect", "monkey_patch_torch_reductions")
        ]
        assert names == [
            "flush_cache",
            "flush_cache",
            "release_memory_occupation",  # all
            "empty_cache",
            "resume_memory_occupation",  # weights
            "begin_weight_update",
            *["update_weights_from_tensor"] * len(weights(version)),
            "end_weight_update",
            "flush_cache",
            "update_weight_version",
        ]
        assert calls(f, "release_memory_occupation", "resume_memory_occupation") == [
            ("release_memory_occupation", None),
            ("resume_memory_occupation", ["weights"]),
        ]
        n = len(f.log)
        two = [req([1, 2], f"{first}{i}", max_new_tokens=3, seed=i) for i in range(2)]
        if first == "generate":  # two calls at once: one restore, before either is admitted
            threads = [run_in_thread(lambda x=x: eng.generate([x])) for x in two]
            outs = [c for t, box in threads for c in join(t, box)]
        else:
            outs = list(eng.stream(two))
        new = [c for c in f.log[n:] if c[0] not in ("finish",)]
        assert new[:2] == [
            ("empty_cache",),
            ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
        ]
        assert [c[0] for c in new[2:]] == ["dispatch", "dispatch"]
        assert all(c.versions == [version] * 3 for c in outs)
        for c, x in zip(sorted(outs, key=lambda c: c.request_id), two):
            ref = reference_logprobs(version, x.prompt_ids, c.token_ids, 1.0)
            assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-4
    eng.shutdown()


def test_sleep_after_a_publish_without_generating(fake, model_path):
    """A publish leaves only the weights in memory: sleeping then releases the weights only (a
    release of the never-restored KV tags would be wrong) and the next cycle still works."""
    eng = make_engine(model_path)
    f = fake[-1]
    eng.sleep()
    eng.wake()
    eng.publish_weights(weights(1), version=1)
    eng.sleep()
    assert calls(f, "release_memory_occupation")[-1] == ("release_memory_occupation", ["weights"])
    assert f.released == {"weights", "kv_cache", "cuda_graph"}
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([req([1], "a", max_new_tokens=2, seed=0)])
    eng.wake()
    eng.publish_weights(weights(2), version=2)
    (c,) = eng.generate([req([1], "a", max_new_tokens=2, seed=0)])
    assert c.versions == [2, 2] and f.released == set()
    eng.shutdown()


def test_sleep_with_cpu_backup_restores_weights(fake, model_path):
    eng = make_engine(model_path, weights_cpu_backup=True)
    f = fake[-1]
    r = req([4, 5], "a", max_new_tokens=5, seed=3)
    (before,) = eng.generate([r])
    eng.sleep()
    eng.wake()
    assert calls(f)[-1] == ("resume_memory_occupation", None)
    (after,) = eng.generate([r])  # no publish needed
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    eng.shutdown()


def test_overlap_mode_sleep_wake_are_noops(fake, model_path):
    eng = make_engine(model_path, memory_mode="overlap")
    n = len(fake[-1].log)
    eng.sleep()
    eng.wake()
    assert len(fake[-1].log) == n
    eng.shutdown()


def test_sleep_needs_idle_engine(fake, model_path):
    eng = make_engine(model_path)
    t, box = run_in_thread(lambda: eng.generate([req([1], "long", max_new_tokens=400, seed=0)]))
    wait_for(lambda: fake[-1].progress().get("0#long", 0) >= 2)
    with pytest.raises(RuntimeError, match="idle"):
        eng.sleep()
    eng.abort()
    join(t, box)
    eng.shutdown()


def test_partial_rollout_versions_are_exact(fake, model_path):
    """pause -> publish -> resume: token i carries the version that sampled it."""
    eng = make_engine(model_path)
    f = fake[-1]
    r = req([5, 6, 7], "span", max_new_tokens=150, seed=11)
    t, box = run_in_thread(lambda: eng.generate([r]))
    wait_for(lambda: f.progress().get("0#span", 0) >= 5)
    eng.pause()
    (pause,) = calls(f, "pause_generation")
    assert pause[1] == "retract"
    n_old = pause[2]["0#span"]
    time.sleep(0.02)
    assert f.progress()["0#span"] == n_old  # paused: no token is produced
    eng.publish_weights(weights(1), version=1)
    eng.resume()
    (c,) = join(t, box)
    assert 5 <= n_old < 150 and len(c.token_ids) == 150
    assert c.versions == [0] * n_old + [1] * (150 - n_old)
    old = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)
    new = reference_logprobs(1, r.prompt_ids, c.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(c.logprobs[:n_old], old[:n_old])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(c.logprobs[n_old:], new[n_old:])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(old[n_old:], new[n_old:])) > 1e-2
    # while paused the publish does not wait for the request, and never drains it
    names = [x[0] for x in calls(f) if x[0] != "ipc_collect"]
    i = names.index("pause_generation")
    assert names[i + 1] == "begin_weight_update" and names[-1] == "continue_generation"
    eng.shutdown()


def test_publish_without_pause_drains_and_holds_new_requests(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    first = req([1, 2], "first", max_new_tokens=120, seed=1)
    t1, box1 = run_in_thread(lambda: eng.generate([first]))
    wait_for(lambda: f.progress().get("0#first", 0) >= 3)
    t_pub, box_pub = run_in_thread(lambda: eng.publish_weights(weights(1), version=1))
    time.sleep(0.02)
    second = req([3, 4], "second", max_new_tokens=5, seed=2)
    t2, box2 = run_in_thread(lambda: eng.generate([second]))
    (c1,) = join(t1, box1)
    join(t_pub, box_pub)
    (c2,) = join(t2, box2)
    assert c1.versions == [0] * 120 and c1.finish_reason == "length"
    assert c2.versions == [1] * 5
    log = f.log
    begin = max(i for i, x in enumerate(log) if x[0] == "begin_weight_update")
    assert log.index(("finish", "0#first", "length", 120)) < begin  # drained first
    assert log.index(("update_weight_version", "1", False)) < log.index(("dispatch", "1#second"))
    eng.shutdown()


def test_abort_of_a_running_request_returns_all_its_tokens(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    r = req([1, 2], "a", max_new_tokens=400, seed=0)
    t, box = run_in_thread(lambda: eng.generate([r]))
    wait_for(lambda: f.progress().get("0#a", 0) >= 3)
    (partial,) = eng.abort()
    (c,) = join(t, box)
    assert partial.finish_reason == "abort" and 3 <= len(partial.token_ids) < 400
    assert c == partial
    ref = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) <= 1e-4
    assert ("abort_request", "", True) in f.log
    (c2,) = eng.generate([req([1], "b", max_new_tokens=2, seed=0)])
    assert c2.finish_reason == "length"
    eng.shutdown()


def test_abort_while_paused_returns_the_streamed_prefix(fake, model_path):
    """Known limit: a request that pause() retracted returns only the tokens SGLang had streamed
    to this process (a multiple of SGLANG_FORCE_STREAM_INTERVAL = 50 for non-stream requests)."""
    eng = make_engine(model_path)
    f = fake[-1]
    r = req([1, 2], "a", max_new_tokens=400, seed=0)
    t, box = run_in_thread(lambda: eng.generate([r]))
    wait_for(lambda: f.progress().get("0#a", 0) >= 60)
    eng.pause()
    n = calls(f, "pause_generation")[0][2]["0#a"]
    (partial,) = eng.abort()
    (c,) = join(t, box)
    assert c == partial and c.finish_reason == "abort"
    assert len(c.token_ids) == (n // 50) * 50 >= 50
    assert c.versions == [0] * len(c.token_ids)
    # aborted where it waits: no further step, and the engine stays paused
    names = [x[0] for x in calls(f)]
    assert names[-2:] == ["pause_generation", "abort_request"]
    t2, box2 = run_in_thread(lambda: eng.generate([req([1], "b", max_new_tokens=2, seed=0)]))
    time.sleep(0.05)
    assert t2.is_alive()
    eng.resume()
    assert join(t2, box2)[0].finish_reason == "length"
    eng.shutdown()


# ----------------------------------------------------------------------------------------------
# Streams: finishing order, per-request aborts, partials with exact versions


def greq(prompt, rid, group=None, **params) -> GenerateRequest:
    return GenerateRequest(list(prompt), SamplingParams(**params), rid, group=group)


def aborts(f: FakeEngine) -> list[tuple]:
    return calls(f, "abort_request")


def test_stream_hands_over_each_completion_when_it_ends(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    reqs = [greq([1, 2], "long", max_new_tokens=400, seed=0), greq([3], "short", max_new_tokens=2)]
    it = eng.stream(reqs)
    first = next(it)
    assert first.request_id == "short" and first.finish_reason == "length"
    assert 0 < f.progress()["0#long"] < 400  # still generating when the first one came
    (last,) = list(it)
    assert last.request_id == "long" and len(last.token_ids) == 400
    assert aborts(f) == []  # no until_groups: nothing is stopped
    eng.shutdown()


def test_stream_until_groups_aborts_the_rest_with_exact_versions(fake, model_path):
    """pause -> publish -> resume while a stream runs; group g completes, the tail is aborted by
    its rid: every completion's tokens carry the version that sampled them, and each part
    matches the trainer's weights of that version."""
    eng = make_engine(model_path)
    f = fake[-1]
    reqs = [
        greq([5, 6, 7], "tail", max_new_tokens=400, seed=3),
        greq([1, 2], "g0", group="g", max_new_tokens=120, seed=1),
        greq([2, 1], "g1", group="g", max_new_tokens=90, seed=2),
    ]
    t, box = run_in_thread(lambda: list(eng.stream(reqs, until_groups=1)))
    wait_for(lambda: f.progress().get("0#tail", 0) >= 5)
    eng.pause()
    at_pause = calls(f, "pause_generation")[0][2]
    eng.publish_weights(weights(1), version=1)
    eng.resume()
    outs = join(t, box)
    assert [c.request_id for c in outs] == ["g1", "g0", "tail"]
    assert [c.finish_reason for c in outs] == ["length", "length", "abort"]
    assert aborts(f) == [("abort_request", "0#tail", False)]  # one request, by its rid
    tail = outs[-1]
    assert 90 <= len(tail.token_ids) < 400
    for c, rid in zip(outs, ("2#g1", "1#g0", "0#tail")):
        n_old = at_pause[rid]
        assert 0 < n_old < len(c.token_ids)
        assert c.versions == [0] * n_old + [1] * (len(c.token_ids) - n_old)
        r = next(x for x in reqs if x.request_id == c.request_id)
        old = reference_logprobs(0, r.prompt_ids, c.token_ids, 1.0)
        new = reference_logprobs(1, r.prompt_ids, c.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(c.logprobs[:n_old], old[:n_old])) <= 1e-4
        assert max(abs(a - b) for a, b in zip(c.logprobs[n_old:], new[n_old:])) <= 1e-4
    eng.sleep()  # nothing of the call is left in flight
    eng.shutdown()


def test_stream_stops_only_its_own_requests_beside_a_generate(fake, model_path):
    """SGLang aborts every rid that starts with the aborted one: the stream's "1#x" must not hit
    the concurrent generate's "10#x" (with "<id>#<counter>" rids, "x#1" would hit "x#10")."""
    eng = make_engine(model_path)
    f = fake[-1]
    reqs = [
        greq([1], "g0", group="g", max_new_tokens=2, seed=0),
        greq([1, 2], "x", max_new_tokens=400, seed=1),
        greq([2], "g1", group="g", max_new_tokens=150, seed=2),
    ]
    ts, box_s = run_in_thread(lambda: list(eng.stream(reqs, until_groups=1)))
    wait_for(lambda: any(n >= 3 for rid, n in f.progress().items() if "g1" in rid))
    fillers = [greq([3], f"f{i}", max_new_tokens=1, seed=i) for i in range(7)]
    other = greq([1, 2], "x", max_new_tokens=400, seed=5)
    tg, box_g = run_in_thread(lambda: eng.generate([*fillers, other]))
    outs = join(ts, box_s)
    assert [c.request_id for c in outs] == ["g0", "g1", "x"]
    assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 400
    got = join(tg, box_g)[-1]
    assert got.finish_reason == "length" and len(got.token_ids) == 400
    assert {"1#x", "10#x"} <= set(f.sampling)
    assert aborts(f) == [("abort_request", "1#x", False)]
    eng.shutdown()


def test_stream_closed_early_aborts_the_rest_and_waits_for_them(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    longs = [greq([1, 2], f"long{i}", max_new_tokens=400, seed=i) for i in range(2)]
    it = eng.stream([greq([3], "short", max_new_tokens=1, seed=0), *longs])
    assert next(it).request_id == "short"
    it.close()
    assert f.live == {}  # both ended before close() returned
    assert aborts(f) == [("abort_request", "1#long0", False), ("abort_request", "2#long1", False)]
    ended = [c for c in f.log if c[0] == "finish" and "#long" in c[1]]
    assert [c[2] for c in ended] == ["abort", "abort"] and all(c[3] < 400 for c in ended)
    eng.sleep()  # idle at once
    eng.wake()
    eng.publish_weights(weights(1), version=1)
    # dropping the iterator after a break closes it as well
    for c in eng.stream([greq([3], "short", max_new_tokens=1, seed=0), *longs]):
        assert c.request_id == "short"
        break
    assert f.live == {} and len(aborts(f)) == 4
    (c,) = eng.generate([greq([1], "after", max_new_tokens=2, seed=0)])
    assert c.finish_reason == "length" and c.versions == [1, 1]
    eng.shutdown()


def test_stream_closed_while_paused_returns_at_once_and_stays_paused(fake, model_path):
    """While paused the stream's retracted requests are aborted where they wait (their abort is
    answered at once); nothing else runs: no continue_generation, and the engine stays paused."""
    eng = make_engine(model_path)
    f = fake[-1]
    it = eng.stream([greq([1, 2], f"long{i}", max_new_tokens=400, seed=i) for i in range(2)])
    wait_for(lambda: min(f.progress().get(f"{i}#long{i}", 0) for i in range(2)) >= 3)
    eng.pause()
    steps = f.steps
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 5.0 and f.live == {} and f.steps == steps
    assert [c[0] for c in calls(f)][-3:] == ["pause_generation", "abort_request", "abort_request"]
    # a stream started while paused waits at the gate: closing it ends its requests unsent
    gated = eng.stream([greq([1], "gated", max_new_tokens=2, seed=0)])
    gated.close()
    assert "gated" not in str(f.log) and f.live == {}
    t, box = run_in_thread(lambda: eng.generate([greq([1], "b", max_new_tokens=2, seed=0)]))
    time.sleep(0.05)
    assert t.is_alive()  # still paused
    eng.resume()
    assert join(t, box)[0].finish_reason == "length"
    eng.shutdown()


def test_engine_abort_ends_a_stream_with_its_partials(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    reqs = [greq([1, 2], f"r{i}", group="g", max_new_tokens=400, seed=i) for i in range(2)]
    t, box = run_in_thread(lambda: list(eng.stream(reqs, until_groups=1)))
    wait_for(lambda: min(f.progress().get(f"{i}#r{i}", 0) for i in range(2)) >= 3)
    partial = eng.abort()
    outs = join(t, box)
    assert sorted(c.request_id for c in outs) == ["r0", "r1"]
    assert all(c.finish_reason == "abort" and 3 <= len(c.token_ids) < 400 for c in outs)
    assert {c.request_id: c for c in partial} == {c.request_id: c for c in outs}
    assert aborts(f) == [("abort_request", "", True)]  # an aborted group is not complete
    (c,) = eng.generate([greq([1], "after", max_new_tokens=2, seed=0)])
    assert c.finish_reason == "length"
    eng.shutdown()


def test_stream_refuses_before_admitting_anything(fake, model_path):
    eng = make_engine(model_path, publish_v0=False)
    f = fake[-1]
    with pytest.raises(RuntimeError, match="publish_weights"):
        eng.stream([greq([1], "a", max_new_tokens=2)])
    eng.publish_weights(weights(0), version=0)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.stream([greq([1], "a", max_new_tokens=2)])
    with pytest.raises(ValueError, match="until_groups"):
        eng.stream([greq([1], "a", max_new_tokens=2)], until_groups=True)
    assert calls(f, "dispatch") == [] and list(eng.stream([])) == []
    eng.shutdown()


def test_failed_bucket_ends_the_session_and_blocks_generation(fake, model_path):
    eng = make_engine(model_path)
    f = fake[-1]
    f.fail_bucket = f.updates_seen + 1  # the second bucket of the next publish fails
    with pytest.raises(RuntimeError, match="bucket 1: injected failure"):
        eng.publish_weights(weights(1), version=1)
    assert calls(f)[-1] == ("end_weight_update",)
    assert eng.version == 0
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate([req([1], "a", max_new_tokens=2)])
    eng.publish_weights(weights(1), version=1)
    (c,) = eng.generate([req([1], "a", max_new_tokens=2, seed=0)])
    assert c.versions == [1, 1]
    eng.shutdown()


def test_dummy_weights_refuse_generation_until_published(fake, model_path):
    eng = make_engine(model_path, publish_v0=False)
    with pytest.raises(RuntimeError, match="publish_weights"):
        eng.generate([req([1], "a", max_new_tokens=2)])
    assert calls(fake[-1], "dispatch") == []
    eng.shutdown()


def test_stop_ids_and_model_eos(fake, model_path):
    """SGLang also stops at the model's EOS ids when a request has stop ids; without stop ids
    the backend sets ignore_eos so that nothing stops the response (the protocol)."""
    eng = make_engine(model_path)
    f = fake[-1]
    f.eos = set(range(ARGS.vocab_size))  # every token is an EOS of the model
    (free,) = eng.generate([req([1], "a", max_new_tokens=6, seed=0)])
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    (stopped,) = eng.generate([req([1], "b", max_new_tokens=6, seed=0, stop_token_ids=(999,))])
    assert len(stopped.token_ids) == 1 and stopped.finish_reason == "stop"
    eng.shutdown()


def test_blocking_methods_refuse_a_running_event_loop(fake, model_path):
    eng = make_engine(model_path)

    async def inside():
        eng.generate([req([1], "a", max_new_tokens=2)])

    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(inside())
    eng.shutdown()


def test_instantiate_from_yaml_component(fake, model_path):
    """As the recipe builds every engine: the config node plus ``model_args``."""
    eng = instantiate(
        {
            "_component_": "minippo.engine.sglang_engine.SGLangEngine",
            "model_path": model_path,
            "mem_fraction_static": 0.3,
            "memory_mode": "sleep",
            "dtype": "bf16",
            "extra_server_args": {"chunked_prefill_size": 4096},
        },
        model_args=ARGS,
    )
    assert isinstance(eng, SGLangEngine)
    assert eng.model_args is ARGS
    assert eng.dtype == torch.bfloat16 and fake[-1].kwargs["dtype"] == "bfloat16"
    assert fake[-1].kwargs["mem_fraction_static"] == 0.3
    assert fake[-1].kwargs["chunked_prefill_size"] == 4096
    eng.shutdown()


# ----------------------------------------------------------------------------------------------
# Validation before anything is started


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mem_fraction_static=1.2), "mem_fraction_static"),
        (dict(memory_mode="swap"), "memory_mode"),
        (dict(dtype="int8"), "dtype"),
        (dict(port_stride=1), "port_stride"),
        (dict(base_port=65530, local_rank=2), "65535"),
        (dict(weights_cpu_backup=True, memory_mode="overlap"), "weights_cpu_backup"),
        (dict(extra_server_args={"tp_size": 2}), "tp_size"),
    ],
)
def test_bad_config_raises_before_the_engine_starts(fake, model_path, kw, match):
    with pytest.raises(ValueError, match=match):
        SGLangEngine(model_path, **kw)
    assert fake == []


@pytest.mark.parametrize(
    "var, value, match",
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "expandable_segments"),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True", "PYTORCH_ALLOC_CONF"),
        ("SGLANG_RETURN_ORIGINAL_LOGPROB", "1", "temperature-1"),
    ],
)
def test_environment_checked_before_the_engine_starts(
    fake, model_path, monkeypatch, var, value, match
):
    monkeypatch.setenv(var, value)
    with pytest.raises(RuntimeError, match=match):
        SGLangEngine(model_path)
    assert fake == []


# ----------------------------------------------------------------------------------------------
# Seeds: honoured only with deterministic inference (R4)


def test_seeds_are_not_sent_without_deterministic_inference(fake, model_path):
    """SGLang drops sampling_seed unless enable_deterministic_inference: the backend says so
    (honours_seeds False), does not send it, and runs seeded top-k / top-p requests."""
    eng = make_engine(model_path, enable_deterministic_inference=False)
    f = fake[-1]
    assert eng.honours_seeds is False
    assert f.kwargs["enable_deterministic_inference"] is False
    r = req([1, 2], "a", temperature=1.0, top_k=5, top_p=0.9, seed=1, max_new_tokens=12)
    (a,) = eng.generate([r])
    (b,) = eng.generate([r])
    assert len(a.token_ids) == 12
    assert all("sampling_seed" not in sp for sp in f.sampling.values())
    assert a.token_ids != b.token_ids  # the same seed does not reproduce the sample
    eng.shutdown()


def test_deterministic_inference_honours_seeds_and_seeds_unseeded_requests(fake, model_path):
    eng = make_engine(model_path, enable_deterministic_inference=True, random_seed=3)
    f = fake[-1]
    assert eng.honours_seeds is True
    assert f.kwargs["sampling_backend"] == "pytorch"  # what deterministic mode runs anyway
    seeded = req([1, 2], "s", temperature=1.0, top_k=5, top_p=0.9, seed=1, max_new_tokens=12)
    (a,) = eng.generate([seeded])
    (b,) = eng.generate([seeded])
    assert a.token_ids == b.token_ids
    # SGLang gives every request without a seed the seed 42: the backend draws one per request,
    # so n samples of one prompt differ (as the protocol promises for seed=None)
    unseeded = [req([1, 2], f"u{i}", temperature=1.0, max_new_tokens=12) for i in range(2)]
    u = eng.generate(unseeded)
    assert u[0].token_ids != u[1].token_ids
    sent = [f.sampling[rid]["sampling_seed"] for rid in f.sampling if "#u" in rid]
    assert len(set(sent)) == 2
    greedy = eng.generate([req([1, 2], "g", temperature=0.0, max_new_tokens=3)])
    assert greedy and "sampling_seed" not in f.sampling["4#g"]
    eng.shutdown()


def test_deterministic_inference_refuses_another_sampling_backend(fake, model_path):
    with pytest.raises(ValueError, match=r"engine\.sampling_backend"):
        SGLangEngine(model_path, enable_deterministic_inference=True, sampling_backend="flashinfer")
    assert fake == []


# ----------------------------------------------------------------------------------------------
# Published names and shapes are checked before anything reaches the engine (R2)


def test_model_args_must_match_the_engine_config(fake, model_path):
    other = replace(ARGS, n_layers=ARGS.n_layers + 1, intermediate_size=ARGS.intermediate_size * 2)
    with pytest.raises(ValueError, match=r"config\.json") as err:
        SGLangEngine(model_path, model_args=other)
    msg = str(err.value)
    assert f"model.layers.{ARGS.n_layers}.self_attn.q_proj.weight" in msg  # not in the engine
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "shape" in msg
    assert fake == []  # refused before the engine started


def test_a_misspelt_name_is_refused_before_it_is_sent(fake, model_path):
    """SGLang's Qwen3 load_weights only warns on an unknown name and keeps its dummy weights."""
    eng = make_engine(model_path, publish_v0=False)
    f = fake[-1]
    buckets = weights(0)
    name, t = buckets[1][0]
    buckets[1][0] = (name.replace("weight", "weigth"), t)
    with pytest.raises(ValueError, match=r"bucket 1 .*weigth is not a weight of the engine"):
        eng.publish_weights(buckets, version=0)
    pushed = calls(f, "update_weights_from_tensor")
    assert len(pushed) == 1 and f.warnings == []  # bucket 0 only; nothing was skipped by SGLang
    assert calls(f)[-1] == ("end_weight_update",)
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate([req([1], "a", max_new_tokens=2)])
    eng.shutdown()


def test_a_publish_must_cover_every_weight(fake, model_path):
    eng = make_engine(model_path, publish_v0=False)
    with pytest.raises(ValueError, match=r"did not publish .*model\.norm\.weight"):
        eng.publish_weights(weights(0)[:-1], version=0)
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate([req([1], "a", max_new_tokens=2)])
    eng.shutdown()


# ----------------------------------------------------------------------------------------------
# Fatal engine errors are process death: scenarios run in a child process


def _scenario_engine(api=None, **kw) -> tuple[SGLangEngine, FakeEngine]:
    """Build an engine on the stand-in outside pytest (for run_scenario); ``api`` replaces the
    stand-in's SGLang names."""
    import tempfile

    install_stand_in(lambda obj, name, value: setattr(obj, name, value))
    if api is not None:
        backend._load_sglang_api = api
    folder = Path(tempfile.mkdtemp())
    cfg = hf_config_from_model_args(ARGS)
    cfg["eos_token_id"] = EOS
    (folder / "config.json").write_text(json.dumps(cfg))
    return make_engine(str(folder), **kw), FakeEngine.instances[-1]


def scenario_paths_that_are_fatal_in_sglang() -> None:
    """Two things that would kill the rank if they reached SGLang; the backend avoids both."""
    eng, f = _scenario_engine()
    # 1. releasing inside the scheduler's last-batch window (right after the last request ends)
    eng.generate([req([1, 2], "a", max_new_tokens=3, seed=0)])
    eng.sleep()
    eng.wake()
    eng.publish_weights(weights(1), version=1)
    (c,) = eng.generate([req([1, 2], "b", max_new_tokens=3, seed=0)])
    print(f"SLEPT AND WOKE: versions {c.versions}")
    # 2. a wrong shape: SGLang's weight loader asserts
    buckets = weights(2)
    name, t = buckets[0][0]
    buckets[0][0] = (name, t[:-1])
    n_pushed = len(calls(f, "update_weights_from_tensor"))
    try:
        eng.publish_weights(buckets, version=2)
    except ValueError as e:
        assert len(calls(f, "update_weights_from_tensor")) == n_pushed
        print(f"REFUSED: {e}")
    eng.shutdown()


def scenario_death_during_wake() -> None:
    os.environ["RANK"] = "5"
    eng, f = _scenario_engine()
    eng.sleep()
    f.fatal_on = "resume_memory_occupation"
    eng.wake()  # the scheduler dies here; this must end the process with our traceback


def scenario_death_during_background_generate() -> None:
    eng, f = _scenario_engine()
    f.oom_at_step = f.steps + 20
    t, box = run_in_thread(lambda: eng.generate([req([1], "long", max_new_tokens=400, seed=0)]))
    try:
        while t.is_alive():
            time.sleep(0.01)  # the main thread idles (training); SIGQUIT arrives here
    except backend.SGLangEngineDied:
        print("MAIN: SGLangEngineDied")
    t.join(10)
    print(f"GENERATE THREAD: {type(box.get('error')).__name__}")
    with pytest.raises(backend.SGLangEngineDied):
        eng.pause()
    print("LATER CALLS: SGLangEngineDied")


def run_with_real_pieces(structs: dict[str, type], serializer: Any) -> dict[str, Any]:
    """The backend on the stand-in, with SGLang's real request structs and its real
    MultiprocessingSerializer (tests/sglang_pieces.py runs this where they import)."""
    global SERIALIZER

    def real_api() -> SimpleNamespace:
        api = _fake_api()
        for name, cls in structs.items():
            if hasattr(api, name):
                setattr(api, name, cls)
        api.MultiprocessingSerializer = serializer
        CURRENT_API[:] = [api]
        return api

    SERIALIZER = serializer
    eng, f = _scenario_engine(api=real_api)
    (a,) = eng.generate([req([1, 2], "a", max_new_tokens=4, seed=0)])
    eng.pause()
    eng.publish_weights(weights(1), version=1)
    eng.resume()
    eng.sleep()
    eng.wake()
    eng.publish_weights(weights(2), version=2)
    (b,) = eng.generate([req([1, 2], "b", max_new_tokens=4, seed=0)])
    eng.shutdown()
    equal = all(
        torch.equal(p, dict(model_of(2).named_parameters())[n].detach().float())
        for n, p in f.model.named_parameters()
    )
    return {
        "structs": sorted(f.structs),
        "calls": [c[0] for c in calls(f) if c[0] != "ipc_collect"],
        "versions": [a.versions, b.versions],
        "weights_bit_exact": equal,
    }


SCENARIOS = {
    f.__name__.removeprefix("scenario_"): f
    for f in (
        scenario_paths_that_are_fatal_in_sglang,
        scenario_death_during_wake,
        scenario_death_during_background_generate,
    )
}


def run_scenario(name: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    code = f"from tests.unit.test_sglang_engine import SCENARIOS; SCENARIOS[{name!r}]()"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_paths_that_are_fatal_in_sglang_never_reach_it():
    """R9: the overlap scheduler holds its last batch one more iteration after the last output;
    a release there fails its idle assert (fatal): the backend first flushes until a flush
    succeeds. R2: a wrong shape would fail SGLang's weight loader (fatal): the backend refuses
    the bucket before sending it."""
    proc = run_scenario("paths_that_are_fatal_in_sglang")
    assert proc.returncode == 0, f"rc={proc.returncode} (-9 = SIGKILLed)\n{proc.stderr[-3000:]}"
    assert "SLEPT AND WOKE: versions [1, 1, 1]" in proc.stdout
    assert "REFUSED:" in proc.stdout and "model.embed_tokens.weight has shape" in proc.stdout
    assert "Scheduler hit an exception" not in proc.stderr


def test_engine_death_is_loud_and_names_rank_and_call():
    proc = run_scenario("death_during_wake")
    assert proc.returncode == 1, f"rc={proc.returncode} (-9 = SIGKILLed)\n{proc.stderr[-3000:]}"
    err = proc.stderr
    assert "Scheduler hit an exception" in err  # the scheduler's traceback comes first
    line = next(x for x in err.splitlines() if x.startswith("[minippo] rank 5"))
    assert "the SGLang engine died" in line and "wake" in line
    assert "resume_memory_occupation(weights)" in line and "stderr just above" in line
    assert err.index("Scheduler hit an exception") < err.index("[minippo] rank 5")
    assert "SGLangEngineDied" in err.splitlines()[-1]  # our traceback ends the process


def test_engine_death_reaches_every_waiting_thread():
    proc = run_scenario("death_during_background_generate")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert "CUDA out of memory" in proc.stderr and "generate" in proc.stderr
    for line in ("MAIN: SGLangEngineDied", "GENERATE THREAD: SGLangEngineDied", "LATER CALLS"):
        assert line in proc.stdout


# ----------------------------------------------------------------------------------------------
# Allocator hygiene, timeouts, failed publishes while paused, idle races (R3, R6, R8, R9)


def test_continue_generation_keeps_the_engine_cache(fake, model_path):
    eng = make_engine(model_path, memory_mode="overlap")
    eng.pause()
    eng.resume()
    assert calls(fake[-1], "continue_generation") == [("continue_generation", False)]
    eng.shutdown()


def test_tokenizer_manager_calls_time_out_naming_the_call(fake, model_path):
    eng = make_engine(model_path, call_timeout_s=0.3)
    fake[-1].hang_on.add("pause_generation")
    t, box = run_in_thread(eng.pause)
    t.join(10)
    assert not t.is_alive(), "pause() hung: no timeout on the tokenizer-manager call"
    assert isinstance(box.get("error"), TimeoutError)
    assert "tokenizer_manager.pause_generation did not answer within 0.3 s" in str(box["error"])
    # SGLang keeps the reply slot of the timed-out call armed: a late reply would answer the next
    # call of its kind. So nothing more is sent; shutdown still works.
    fake[-1].hang_on.clear()
    before = len(fake[-1].log)
    with pytest.raises(RuntimeError, match=r"unusable after a timed-out call.*pause_generation"):
        eng.resume()
    with pytest.raises(RuntimeError, match="unusable after a timed-out call"):
        eng.generate([req([1, 2], "a", max_new_tokens=2)])
    assert len(fake[-1].log) == before
    eng.shutdown()
    assert calls(fake[-1], "shutdown") == [("shutdown",)]


def test_failed_publish_while_paused_aborts_the_retracted_requests(fake, model_path):
    """R8: the retracted requests must not resume on half-loaded weights stamped with the old
    version; they end as aborts with the tokens sampled before the pause."""
    eng = make_engine(model_path)
    f = fake[-1]
    r = req([5, 6, 7], "span", max_new_tokens=150, seed=11)
    t, box = run_in_thread(lambda: eng.generate([r]))
    wait_for(lambda: f.progress().get("0#span", 0) >= 55)
    eng.pause()
    n_pause = calls(f, "pause_generation")[0][2]["0#span"]

    def half_then_fail():
        yield weights(1)[0]
        raise RuntimeError("all-gather failed")

    with pytest.raises(RuntimeError, match="all-gather failed"):
        eng.publish_weights(half_then_fail(), version=1)
    eng.resume()
    (c,) = join(t, box)
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) <= n_pause
    assert c.versions == [0] * len(c.token_ids) and eng.version == 0
    assert ("update_weights_from_tensor" in [x[0] for x in f.log]) and f.steps <= n_pause
    eng.shutdown()


def test_publish_right_after_a_drain_retries_the_flush(fake, model_path):
    eng = make_engine(model_path, memory_mode="overlap")
    f = fake[-1]
    eng.generate([req([1, 2], "a", max_new_tokens=3, seed=0)])
    eng.publish_weights(weights(1), version=1)
    assert calls(f, "flush_cache")[-2:] == [("flush_cache", False), ("flush_cache", True)]
    assert eng.version == 1
    eng.shutdown()


def test_flush_gives_up_after_bounded_attempts(fake, model_path, monkeypatch):
    monkeypatch.setattr(backend, "FLUSH_ATTEMPTS", 3)
    eng = make_engine(model_path, memory_mode="overlap")
    f = fake[-1]
    f.idle_lag = 10**6  # never idle
    with pytest.raises(RuntimeError, match="flush_cache after the weight update failed 3 times"):
        eng.publish_weights(weights(1), version=1)
    assert calls(f, "flush_cache")[-3:] == [("flush_cache", False)] * 3
    f.idle_lag = 0
    eng.shutdown()


# ----------------------------------------------------------------------------------------------
# The environment the engine's processes start with (R5)


def test_engine_processes_do_not_inherit_torchrun_agent_store(fake, model_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    eng = make_engine(model_path, publish_v0=False)
    assert "TORCHELASTIC_USE_AGENT_STORE" not in fake[-1].spawn_env
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # restored for this process
    eng.shutdown()


def test_sigquit_handler_is_ours_while_the_engine_lives(fake, model_path):
    before = signal.getsignal(signal.SIGQUIT)
    eng = make_engine(model_path, publish_v0=False)
    assert fake[-1].kwargs["custom_sigquit_handler"] is process_care.on_engine_death
    assert signal.getsignal(signal.SIGQUIT) is process_care.on_engine_death
    eng.shutdown()
    assert signal.getsignal(signal.SIGQUIT) == before


# ----------------------------------------------------------------------------------------------
# Pure helpers


def test_sampling_params_mapping():
    assert sglang_sampling_params(SamplingParams(), send_seed=True) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 128, "ignore_eos": True,
    }  # fmt: skip
    sp = sglang_sampling_params(
        SamplingParams(
            temperature=0.5, top_k=4, top_p=0.9, max_new_tokens=7, stop_token_ids=(2, 3), seed=9
        ),
        send_seed=True,
    )
    assert sp == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "max_new_tokens": 7,
        "stop_token_ids": [2, 3], "sampling_seed": 9,
    }  # fmt: skip
    assert "sampling_seed" not in sglang_sampling_params(
        SamplingParams(temperature=0.0, seed=1), send_seed=True
    )
    assert "sampling_seed" not in sglang_sampling_params(SamplingParams(seed=1), send_seed=False)


def test_engine_ports():
    assert engine_ports(30000, 0, 8) == (30000, 30001)
    assert engine_ports(30000, 7, 8) == (30056, 30057)
    with pytest.raises(ValueError, match="local_rank"):
        engine_ports(30000, -1, 8)


def _span(v, s, e):
    return {"version": str(v), "start": s, "end": e}


def test_token_versions_from_spans():
    meta = {"weight_versions": [_span(2, 0, 3), _span(3, 3, 5)], "weight_version": "3"}
    assert token_versions(meta, 5, low=2, high=3) == [2, 2, 2, 3, 3]
    assert token_versions({"weight_versions": [_span(4, 0, 0)]}, 0, low=4, high=4) == []
    with pytest.raises(RuntimeError, match="contiguous"):
        token_versions({"weight_versions": [_span(2, 0, 2), _span(3, 3, 5)]}, 5, low=2, high=3)
    with pytest.raises(RuntimeError, match="outside"):
        token_versions({"weight_versions": [_span(1, 0, 5)]}, 5, low=2, high=3)
    with pytest.raises(RuntimeError, match="outside"):  # decreasing
        token_versions({"weight_versions": [_span(3, 0, 2), _span(2, 2, 5)]}, 5, low=2, high=3)
    with pytest.raises(RuntimeError, match="cover 4"):
        token_versions({"weight_versions": [_span(2, 0, 4)]}, 5, low=2, high=3)
    with pytest.raises(RuntimeError, match="not an integer"):
        token_versions(
            {"weight_versions": [{"version": "default", "start": 0, "end": 1}]}, 1, low=0, high=0
        )
    # without spans: only when no publish happened while the request was in flight
    assert token_versions({"weight_version": "6"}, 2, low=6, high=6) == [6, 6]
    with pytest.raises(RuntimeError, match="cannot be attributed"):
        token_versions({"weight_version": "7"}, 2, low=6, high=7)


def test_completion_from_output_checks_alignment():
    r = req([1, 2], "x", max_new_tokens=3)
    meta = {
        "finish_reason": {"type": "length", "length": 2},
        "weight_version": "0",
        "weight_versions": [_span(0, 0, 2)],
        "output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None)],
    }
    c = completion_from_output(r, {"output_ids": [7, 8], "meta_info": meta}, low=0, high=0)
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason) == (
        [7, 8],
        [-0.5, -1.25],
        [0, 0],
        "length",
    )
    bad = {**meta, "output_token_logprobs": [(-0.5, 7, None), (-1.25, 9, None)]}
    with pytest.raises(RuntimeError, match="for token 9"):
        completion_from_output(r, {"output_ids": [7, 8], "meta_info": bad}, low=0, high=0)
    bad = {**meta, "finish_reason": None}
    with pytest.raises(RuntimeError, match="finish_reason"):
        completion_from_output(r, {"output_ids": [7, 8], "meta_info": bad}, low=0, high=0)


def test_cuda_ipc_collect_is_guarded(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: seen.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend._cuda_ipc_collect()
    assert seen == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend._cuda_ipc_collect()
    assert seen == [1]


# ----------------------------------------------------------------------------------------------
# Behaviour seen on the real engine (tests/sglang_cpu), here with the stand-in


def test_an_abort_in_the_finishing_step_is_labelled_finished(fake, model_path):
    """The stand-in samples one more token for a running request it aborts, as SGLang does, and
    says "abort" even when that token is the last of max_new_tokens: the backend labels it
    "length", so a rollout is never continued with nothing left to sample."""
    eng = make_engine(model_path, memory_mode="overlap")
    f = fake[-1]
    f.step_s = 0.05  # the stop lands between two steps of the other request
    reqs = [
        GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=1, seed=0), "short", "a"),
        GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=1), "other", "b"),
    ]
    short, other = list(eng.stream(reqs, until_groups=1))
    eng.shutdown()
    assert (short.finish_reason, len(short.token_ids)) == ("length", 1)
    raw = [c for c in f.log if c[0] == "finish" and c[1].endswith("#other")]
    assert [(c[2], c[3]) for c in raw] == [("abort", 2)]  # what SGLang said
    assert (other.finish_reason, len(other.token_ids)) == ("length", 2)


@pytest.mark.parametrize(
    "reason, tokens, params, eos, settled",
    [
        ("abort", [5, 9], SamplingParams(max_new_tokens=2), (), "length"),
        ("abort", [5, 9], SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), (), "stop"),
        ("abort", [5, 63], SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), (63,), "stop"),
        ("abort", [5, 63], SamplingParams(max_new_tokens=3), (63,), "abort"),  # ignore_eos
        ("abort", [5, 6], SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), (63,), "abort"),
        ("abort", [], SamplingParams(max_new_tokens=1), (), "abort"),
        ("stop", [9], SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), (), "stop"),
        ("length", [5, 6, 7], SamplingParams(max_new_tokens=3), (), "length"),
    ],
)
def test_settled_finish_reason(reason, tokens, params, eos, settled):
    from minippo.engine import settled_finish_reason

    assert settled_finish_reason(reason, tokens, params, eos) == settled


def test_a_request_may_fill_the_context(fake, model_path):
    """SGLang caps max_new at context - 2 - prompt and refuses prompts of context - 6 tokens or
    more (the stand-in too): the backend gives SGLang CONTEXT_SLACK tokens more than the context it
    checks requests against."""
    eng = make_engine(model_path, memory_mode="overlap", context_length=40)
    assert fake[-1].kwargs["context_length"] == 40 + backend.CONTEXT_SLACK
    outs = eng.generate(
        [
            req(list(range(1, 40)), "a", max_new_tokens=1, seed=0),
            req(list(range(1, 31)), "b", max_new_tokens=10, seed=1),
        ]
    )
    assert [(len(c.token_ids), c.finish_reason) for c in outs] == [(1, "length"), (10, "length")]
    with pytest.raises(ValueError, match="exceeds the engine's context length"):
        eng.generate([req(list(range(1, 31)), "c", max_new_tokens=11)])
    eng.shutdown()


def test_the_trainers_logging_survives_engine_start(fake, model_path):
    """``Engine()`` calls ``logging.basicConfig(level=ERROR, force=True)`` in this process (the
    stand-in too); the backend restores the handlers and the level it found."""
    root = logging.getLogger()
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    root.addHandler(handler)
    try:
        level = root.level
        eng = make_engine(model_path, publish_v0=False, memory_mode="overlap")
        logging.getLogger("minippo.training.nan_guard").warning("step skipped")
        assert records == ["step skipped"] and root.level == level
        eng.shutdown()
    finally:
        root.removeHandler(handler)


def test_each_ranks_engine_samples_with_its_own_seed(fake, model_path, monkeypatch):
    """The same random_seed on every rank would give every engine the same stream of samples."""
    seeds = []
    for rank in (0, 3):
        monkeypatch.setenv("RANK", str(rank))
        eng = make_engine(model_path, publish_v0=False, random_seed=5, memory_mode="overlap")
        seeds.append(fake[-1].kwargs["random_seed"])
        eng.shutdown()
    assert seeds == [5, 8]


def test_the_loop_thread_releases_the_cache_on_its_ranks_gpu(fake, model_path, monkeypatch):
    """The first request after a publish returns the trainer's cached blocks to the driver before
    the KV cache comes back; it runs on the engine-loop thread, which binds this rank's GPU first
    (a new thread's current device is GPU 0, where a cudaFree would create a context)."""
    bound = threading.local()
    monkeypatch.setattr(backend, "_bind_device", lambda d: setattr(bound, "device", d))
    released = []

    def release_cache():
        released.append((threading.current_thread().name, getattr(bound, "device", None)))

    monkeypatch.setattr(backend, "_cuda_release_cache", release_cache)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an engine on cuda:2
    eng = make_engine(model_path, publish_v0=False, local_rank=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    eng._device = None  # the buckets stay on this machine's CPU
    eng.publish_weights(weights(0), version=0)
    eng.sleep()
    eng.wake()
    eng.publish_weights(weights(1), version=1)
    eng.generate([req([1, 2], "a", max_new_tokens=2, seed=0)])  # restores the KV cache
    eng.shutdown()
    on_loop = [device for name, device in released if name.startswith("sglang-engine-loop")]
    assert on_loop == [torch.device("cuda", 2)]


def test_a_port_in_use_is_refused_before_the_engine_starts(fake, model_path, monkeypatch):
    """SGLang's scheduler binds nccl_port at start and dies (fatal to the rank) when another job
    holds it: the backend probes it first and names the key to change."""
    import socket

    monkeypatch.setattr(backend, "check_port_free", REAL_PORT_CHECK)  # not the stand-in's no-op
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        nccl_port = held.getsockname()[1]
        with pytest.raises(ValueError, match=r"engine port \d+ .* is in use.*engine.base_port"):
            backend.check_port_free(nccl_port, base_port=nccl_port - 1, local_rank=0)
        with pytest.raises(ValueError, match=r"set engine\.base_port to a free range"):
            SGLangEngine(model_path, base_port=nccl_port - 1, model_args=ARGS)
    assert not fake  # nothing was started


def test_a_cpu_engine_silences_only_sglangs_no_gpu_kernel_warnings(monkeypatch):
    """SGLang's import warnings that its GPU kernels are missing (AWQ, GGUF, Triton) are dropped in
    the trainer's import and in the engine's processes (PYTHONWARNINGS), while a user's own
    PYTHONWARNINGS filters and every other warning stay."""
    import warnings

    starts = process_care.GPU_KERNEL_IMPORT_WARNINGS
    samples = ["Only CUDA, HIP and XPU support AWQ currently.", *starts[1:]]
    assert all(any(s.startswith(start) for s in samples) for start in starts)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with process_care.gpu_kernel_import_warnings_ignored():
            for message in samples:
                warnings.warn(message, UserWarning, stacklevel=1)
            warnings.warn("Only CUDA, but a DeprecationWarning", DeprecationWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == [
        "Only CUDA, but a DeprecationWarning",
        "something else",
    ]

    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")
    env = {**os.environ, **process_care.cpu_launch_environment(cpu_threads=3)}
    assert env["OMP_NUM_THREADS"] == "3"
    code = (
        "import warnings\n"
        f"for m in {samples!r}: warnings.warn(m, UserWarning)\n"
        "warnings.warn('kept', UserWarning)\n"
        "try:\n    warnings.warn('user filter', ResourceWarning)\n"
        "except ResourceWarning:\n    print('user filter kept')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "user filter kept"
    assert "kept" in proc.stderr and not any(s in proc.stderr for s in starts), proc.stderr
