"""TorchEngine: the embedded rollout engine, pure PyTorch, in its own process.

How it generates (one "wave" at a time):
    1. take up to ``max_batch_size`` waiting requests; left-pad their prompts to P tokens;
    2. prefill: one forward over ``[k, P]`` fills a KVCache, the last position's logits give the
       first token of every row;
    3. decode: one forward over ``[k, 1]`` per step; rows that sampled a stop id or reached their
       ``max_new_tokens`` leave the batch (``KVCache.keep``: finished rows stop costing compute);
    4. between two steps the engine reads its control messages: pause / resume / publish / abort.

All active rows of a wave have generated the same number of tokens, so after a weight publish the
engine re-prefills the active rows (prompt + tokens so far) with the new weights: every token
sampled after a publish is computed entirely by the new weights (no stale keys/values), which is
exactly what "this token was sampled by version v" means to the corrections.

Sampling (``minippo.engine.sampling``): each request's uniforms are drawn once from a generator
seeded by its ``seed``, so a seeded request gives the same tokens whatever else is in the batch (up
to floating-point differences of batched matmuls).

Kernels: on CPU (float32 / bfloat16, oneDNN) every linear layer of the engine's model runs with
weights packed once per publish (``minippo.engine._cpu_kernels``); see docs/engine.md. With
``compile=True`` the decode step (one token per row: forward + lm_head) and the sampler of plain
rows are ``torch.compile``d with dynamic shapes (one graph for every batch size >= 2 and cache
length), compiled at their first use.

Process model: ``TorchEngine(model_args)`` starts a spawned child process that allocates its own
model from the config (no weights are copied at start) and serves requests from a message queue,
so generation really overlaps training in the parent; the first ``publish_weights`` fills it.
``publish_weights`` returns once the weights are copied into shared memory and sent: the engine
applies them while the trainer goes on, before any later request (a failed publish surfaces at
the next call). The child dies with its parent, even one killed with SIGKILL (no orphaned engine
keeps its memory).
``in_process=True`` runs the same serving loop in a thread of the calling process (for tests and
debugging). The parent-side API is thread-safe.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue as queue_lib
import random
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from minippo.config._report import debug
from minippo.engine._cpu_kernels import onednn_linear_available, pack_linears
from minippo.engine.protocol import (
    Completion,
    GenerateRequest,
    GroupCounter,
    WeightBucket,
    compute_dtype,
    validate_requests,
)
from minippo.engine.quantize import (
    check_quant_format,
    quantize_linear_inputs,
    quantize_linear_weights_,
)
from minippo.engine.sampling import request_uniforms, sample_next, sample_unfiltered
from minippo.models import KVCache, ModelArgs, Transformer, native_name


def default_num_threads() -> int:
    """Torch threads of the engine process: half the cores shared by the engines of the ranks on
    this node (``LOCAL_WORLD_SIZE``, set by torchrun; the trainers get the other half), at least
    1: 1 on a 2-core machine, 4 per engine with 16 cores and 2 ranks."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 2) // 2 // ranks_here)


def decode_logits(
    model: Transformer,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor | None,
    cache: KVCache,
) -> torch.Tensor:
    """One decode step: logits ``[k, V]`` of the next token after ``tokens Long[k]`` at
    positions ``pos Long[k, 1]``; ``mask`` Bool[k, S_kv] padding mask over cached + new keys
    (None: no padding); appends the new keys/values to ``cache``. What ``compile=True``
    compiles."""
    h = model(
        tokens[:, None],
        position_ids=pos,
        attention_mask=mask,
        kv_cache=cache,
        return_hidden=True,
    )
    return model.output(h[:, -1])


CUDA_MEMORY_KEYS = (
    "cuda_allocated_bytes",
    "cuda_reserved_bytes",
    "cuda_peak_allocated_bytes",
    "cuda_peak_reserved_bytes",
)


def _cuda_memory(device: torch.device) -> dict[str, int | None]:
    """The engine process's CUDA caching-allocator figures (bytes) on ``device``: allocated and
    reserved now, and their peaks since the engine last woke (or started); None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(CUDA_MEMORY_KEYS)
    return dict(
        zip(
            CUDA_MEMORY_KEYS,
            (
                torch.cuda.memory_allocated(device),
                torch.cuda.memory_reserved(device),
                torch.cuda.max_memory_allocated(device),
                torch.cuda.max_memory_reserved(device),
            ),
        )
    )


# ----------------------------------------------------------------------------------------------
# The serving loop (runs in the child process, or in a thread with in_process=True)


@dataclass
class _Row:
    """One request being generated."""

    request: GenerateRequest
    call_id: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sent: bool = False  # a stream row: already yielded

    def completion(self) -> Completion:
        return Completion(
            request_id=self.request.request_id,
            prompt_ids=list(self.request.prompt_ids),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason or "abort",  # type: ignore[arg-type]
        )


@dataclass
class _Stream:
    """One ``stream`` call: its rows in request order and when it stops."""

    rows: list[_Row]
    counter: GroupCounter


class _Abort(Exception):
    """Raised inside a wave when abort() arrives."""


_LATER = object()  # a handler's result: the reply is sent later (generate: when its rows finish)


def engine_device(device: torch.device | str) -> torch.device:
    """The engine's device: ``device``, where "cuda" without an index means this rank's GPU
    (``cuda:$LOCAL_RANK``, as the trainer's; not the engine process's current device, GPU 0 on
    every rank)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return d


def _empty_model(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The engine's model, allocated in ``dtype`` on ``device`` but not initialised: its values
    come from the first publish."""
    with torch.device("meta"):
        model = Transformer(args)
    return model.to(dtype=dtype).to_empty(device=device).eval()  # to_empty re-ties the lm_head


class _Server:
    """Owns the engine's model; serves messages ``(kind, call_id, payload)`` from ``inbox``.

    Replies ``("ok", call_id, result)`` or ``("error", call_id, message)`` go to ``outbox``.
    """

    def __init__(
        self,
        model_args: ModelArgs,
        *,
        device: torch.device,
        dtype: torch.dtype,
        version: int,
        seed: int,
        max_batch_size: int,
        compact: bool,
        compile: bool,
        inbox: Any,
        outbox: Any,
        quantize: str | None = None,
    ) -> None:
        self.model = _empty_model(model_args, device, dtype)
        self.device, self.dtype = device, dtype
        self.quantize = quantize
        self.version = version
        self.max_batch_size = max_batch_size
        self.compact = compact
        self.inbox, self.outbox = inbox, outbox
        self.seed_rng = random.Random(seed)
        # every name, tied ones included (a tied lm_head, if sent, lands in the embedding)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        # parameters no publish has filled yet (first names of tied ones): the first must fill all
        first_name = {id(p): n for n, p in self.model.named_parameters()}
        self.canonical = {n: first_name[id(p)] for n, p in self.params.items()}
        self.unfilled = set(first_name.values())
        # CPU float32 / bfloat16 with oneDNN: every linear layer (lm_head included) runs with
        # weights packed once per publish; elsewhere the model's own nn.Linear layers
        packable = onednn_linear_available(self.device, self.dtype)
        self.linear_kernel = "onednn_packed" if packable else "torch"
        self.packed = pack_linears(self.model) if packable else []
        if quantize is not None:  # float8: every linear layer's input rounded per token
            quantize_linear_inputs(self.model, quantize)
        # compile=True: dynamic shapes, so that waves of any length and compaction reuse one graph
        # (sizes 0/1 are still specialised: a single row runs eagerly instead of recompiling)
        self.compile = compile
        self.decode = torch.compile(decode_logits, dynamic=True) if compile else decode_logits
        self.sample = torch.compile(sample_unfiltered, dynamic=True) if compile else None
        self.waiting: list[_Row] = []
        self.active: list[_Row] = []  # rows of the running wave
        self.calls: dict[int, list[_Row]] = {}  # generate call -> its rows in request order
        self.streams: dict[int, _Stream] = {}  # stream call -> its rows and stop rule
        self.paused = False
        self.asleep = False
        self.stale_cache = False
        self.publish_failed: str | None = None  # why the last publish failed (refuse to generate)
        self.running = True
        self.stats = {
            "waves": 0,
            "decode_steps": 0,
            "row_steps": 0,
            "reprefills": 0,
            "sleeps": 0,
            "wakes": 0,
        }
        self.handlers: dict[str, Callable[[int, Any], Any]] = {
            "generate": self._on_generate,
            "stream": self._on_stream,
            "stream_cancel": self._on_stream_cancel,
            "pause": self._on_pause,
            "resume": self._on_resume,
            "publish_begin": self._publish,
            "abort": lambda call_id, _: self._abort_all(),
            "stats": lambda call_id, _: {
                **self.stats,
                "linear_kernel": self.linear_kernel,
                "compiled": self.compile,
                "onednn_cache_capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                **_cuda_memory(self.device),
            },
            "sleep": lambda call_id, _: self._sleep_wake("sleep"),
            "wake": lambda call_id, _: self._sleep_wake("wake"),
            "shutdown": self._on_shutdown,
        }

    # -- message loop ------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until shutdown; the closing reply ``("ok", -1, "closed")`` (sent in both modes,
        even if the loop fails) tells the parent's reader thread to stop."""
        try:
            while self.running:
                if self.waiting and not self.paused:
                    self._run_wave()
                else:
                    self._handle(self.inbox.get())
        finally:
            self.outbox.put(("ok", -1, "closed"))

    def _poll(self) -> None:
        """Handle every queued message; while paused, block until resumed. Between two steps."""
        while True:
            try:
                msg = self.inbox.get(block=self.paused)
            except queue_lib.Empty:
                return
            self._handle(msg)
            if not self.running:
                raise _Abort
            if not self.paused and self.inbox.empty():
                return

    def _reply(self, call_id: int, result: Any) -> None:
        self.outbox.put(("ok", call_id, result))

    def _handle(self, msg: tuple) -> None:
        kind, call_id, payload = msg
        try:
            if kind not in self.handlers:
                raise ValueError(f"unknown engine message {kind!r}")
            result = self.handlers[kind](call_id, payload)
            if result is not _LATER:
                self._reply(call_id, result)
        except Exception:
            self.outbox.put(("error", call_id, traceback.format_exc()))

    def _rows(self, call_id: int, requests: list[GenerateRequest]) -> list[_Row]:
        if self.asleep:
            raise RuntimeError("the engine is asleep: call wake() before generating")
        if self.publish_failed is not None:
            raise RuntimeError(f"{self.publish_failed}; publish again before generating")
        rows = []
        for req in requests:
            seed = req.params.seed
            if seed is None:
                seed = self.seed_rng.randrange(1 << 62)
            rows.append(_Row(req, call_id, seed))
        self.waiting.extend(rows)
        return rows

    def _on_generate(self, call_id: int, requests: list[GenerateRequest]) -> object:
        self.calls[call_id] = self._rows(call_id, requests)
        return _LATER  # replied when all rows finish

    def _on_stream(self, call_id: int, payload: tuple[list[GenerateRequest], int | None]) -> object:
        requests, until_groups = payload
        counter = GroupCounter(requests, until_groups)
        self.streams[call_id] = _Stream(self._rows(call_id, requests), counter)
        return _LATER  # parts are sent as rows finish, then the closing reply

    def _on_stream_cancel(self, call_id: int, stream_id: int) -> None:
        """The caller closed the stream early: stop what is left of it."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._stop_rows(stream.rows)
            self._finish_calls()

    def _on_pause(self, call_id: int, _: None) -> None:
        self.paused = True

    def _on_resume(self, call_id: int, _: None) -> None:
        self.paused = False

    def _on_shutdown(self, call_id: int, _: None) -> None:
        self._abort_all()
        self.running = False

    def _publish(self, call_id: int, version: int) -> None:
        """Apply buckets until ``publish_end``; other messages meanwhile are handled normally.

        A bad name or shape fails the publish (after reading the rest of it) and leaves the
        weights partly updated and the version unchanged; until every parameter has been sent
        once, a publish fails too (the engine starts with uninitialised weights). A failed publish
        fails every running generate and stream call (their rows would go on under partly updated
        weights) and the engine refuses new ones until a publish succeeds.
        """
        error: Exception | None = (
            RuntimeError("publish_weights() while the engine sleeps: call wake() first")
            if self.asleep
            else None
        )
        while True:
            kind, cid, payload = self.inbox.get()
            if kind == "publish_end" and cid == call_id:
                break
            if kind != "publish_bucket" or cid != call_id:
                self._handle((kind, cid, payload))
                continue
            if error is not None:
                continue
            try:
                self._load_bucket(payload)
            except Exception as e:
                error = e
        if error is None and self.unfilled:
            missing = sorted(self.unfilled)
            error = ValueError(
                f"publish_weights: the engine starts without weights and {len(missing)} of its "
                f"parameters were never sent ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}); the first publish must send them all"
            )
        if error is not None:
            if not self.asleep:  # a sleeping engine's weights were not touched
                self._fail_calls(f"the publish of version {version} failed: {error}")
            raise error
        if self.quantize is not None:  # the engine samples from rounded weights
            quantize_linear_weights_(self.model, self.quantize)
        for layer in self.packed:
            layer.repack()
        self.version = version
        self.publish_failed = None
        self.stale_cache = True  # in-flight rows re-prefill under the new weights

    def _fail_calls(self, reason: str) -> None:
        """End every generate and stream call with an error; refuse new ones until a publish
        succeeds (``_rows``)."""
        self.publish_failed = reason
        for r in self.active + self.waiting:
            r.finish_reason = r.finish_reason or "abort"
        self.waiting = []
        for call_id in [*self.calls, *self.streams]:
            self.calls.pop(call_id, None)
            self.streams.pop(call_id, None)
            self.outbox.put(("error", call_id, f"{reason}; publish again before generating"))

    @torch.no_grad()
    def _load_bucket(self, bucket: WeightBucket) -> None:
        for name, tensor in bucket:
            native = name if name in self.params else native_name(name)
            if native not in self.params:
                raise KeyError(f"publish_weights: unknown parameter {name!r}")
            p = self.params[native]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"publish_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                    f"engine's parameter has {tuple(p.shape)}"
                )
            p.copy_(tensor)
            self.unfilled.discard(self.canonical[native])

    def _sleep_wake(self, kind: str) -> None:
        """sleep: drop the packed kernel weights (a second copy of every linear weight; the KV
        cache lives only while a wave runs) and move a GPU model to the host; wake: undo."""
        if kind == "sleep" and (self.active or self.waiting):
            raise RuntimeError("sleep() needs an idle engine; abort or wait for requests first")
        if kind == "sleep" and not self.asleep:
            for layer in self.packed:
                layer.drop()
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()
        elif kind == "wake" and self.asleep:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # stats(): peaks while awake
                self.model.to(self.device)
            for layer in self.packed:
                layer.repack()
        else:
            return
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.asleep = kind == "sleep"
        self.stats[f"{kind}s"] += 1

    def _stop_rows(self, rows: list[_Row]) -> None:
        """End ``rows`` that have not finished as partial completions ("abort")."""
        stopped = {id(r) for r in rows if r.finish_reason is None}
        for r in rows:
            if id(r) in stopped:
                r.finish_reason = "abort"
        self.waiting = [r for r in self.waiting if id(r) not in stopped]

    def _finish_calls(self) -> None:
        """Reply to the generate calls whose rows all finished; send each stream the rows that
        finished since the last call (request order), and close the streams that are done."""
        for call_id in [c for c, rows in self.calls.items() if all(r.finish_reason for r in rows)]:
            self._reply(call_id, [r.completion() for r in self.calls.pop(call_id)])
        for call_id, stream in list(self.streams.items()):
            done = [
                (i, r)
                for i, r in enumerate(stream.rows)
                if not r.sent and r.finish_reason in ("stop", "length")
            ]
            if done:
                self.outbox.put(("part", call_id, [r.completion() for _, r in done]))
                for i, r in done:
                    r.sent = True
                    if stream.counter.finish(i):  # enough complete groups: stop the others
                        self._stop_rows(stream.rows)
            stopped = [r for r in stream.rows if not r.sent and r.finish_reason == "abort"]
            if stopped:
                self.outbox.put(("part", call_id, [r.completion() for r in stopped]))
                for r in stopped:
                    r.sent = True
            if all(r.sent for r in stream.rows):
                del self.streams[call_id]
                self._reply(call_id, None)

    def _abort_all(self) -> list[Completion]:
        rows = [r for r in self.active + self.waiting if r.finish_reason is None]
        for r in rows:
            r.finish_reason = "abort"
        self.waiting = []
        self._finish_calls()
        return [r.completion() for r in rows]

    # -- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def _run_wave(self) -> None:
        rows, self.waiting = (
            self.waiting[: self.max_batch_size],
            self.waiting[self.max_batch_size :],
        )
        self.active = rows
        self.stats["waves"] += 1
        try:
            self._generate(rows)
        except _Abort:
            pass
        except Exception:
            msg = traceback.format_exc()
            for call_id in {r.call_id for r in rows}:
                self.calls.pop(call_id, None)
                self.streams.pop(call_id, None)
                self.outbox.put(("error", call_id, msg))
            for r in rows:
                r.finish_reason = r.finish_reason or "abort"
        finally:
            self.active = []
        self._finish_calls()

    def _prefill(
        self, seq: torch.Tensor, mask: torch.Tensor, max_len: int, no_padding: bool
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Forward ``seq [k, L]`` (left-padded, ``mask`` Bool[k, L]; ``no_padding``: mask is all
        True) into a fresh KVCache of ``max_len`` positions; return the last position's logits
        ``[k, V]``, the cache and the last position's position id ``Long[k, 1]``."""
        cache = KVCache(
            self.model.args, seq.shape[0], max_len, dtype=self.dtype, device=self.device
        )
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        h = self.model(
            seq,
            position_ids=pos,
            attention_mask=None if no_padding else mask,
            kv_cache=cache,
            return_hidden=True,
        )
        return self.model.output(h[:, -1]), cache, pos[:, -1:]

    def _generate(self, rows: list[_Row]) -> None:
        dev = self.device
        k = len(rows)
        p_len = max(len(r.request.prompt_ids) for r in rows)
        max_new = max(r.request.params.max_new_tokens for r in rows)
        # prompt (left-padded) | generated tokens, preallocated; seq[:, :col] is what exists so far
        seq = torch.zeros(k, p_len + max_new, dtype=torch.long, device=dev)
        mask = torch.zeros(k, p_len + max_new, dtype=torch.bool, device=dev)
        mask[:, p_len:] = True  # generated columns are never padding
        for i, r in enumerate(rows):
            ids = r.request.prompt_ids
            seq[i, p_len - len(ids) : p_len] = torch.tensor(ids, dtype=torch.long)
            mask[i, p_len - len(ids) : p_len] = True
        params = [r.request.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        stops = [set(p.stop_token_ids) for p in params]
        # every row sampled without top-k / top-p: the compiled sampler applies (compile=True)
        unfiltered = all(p.temperature > 0 and p.top_k == 0 and p.top_p >= 1 for p in params)
        # uniforms[i, t]: the uniform that draws token t of row i (greedy rows draw none)
        uniforms = torch.zeros(k, max_new)
        for i, r in enumerate(rows):
            if r.request.params.temperature > 0:
                n = r.request.params.max_new_tokens
                uniforms[i, :n] = request_uniforms(r.seed, n)
        uniforms = uniforms.to(dev)

        col = p_len  # column of the next sampled tokens
        no_padding = bool(mask.all())
        # pos: position id of the newest token of each row, Long[k, 1]
        logits, cache, pos = self._prefill(seq[:, :col], mask[:, :col], p_len + max_new, no_padding)
        self.stale_cache = False
        while True:
            u = uniforms[:, col - p_len]
            if self.compile and unfiltered and len(rows) > 1:
                tokens, logprobs = self.sample(logits, temperature, u.contiguous())
            else:
                tokens, logprobs = sample_next(logits, temperature, top_k, top_p, u)
            version = self.version
            finished_now = False
            for i, (r, tok, lp) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist())):
                if r.finish_reason is not None:  # only without compaction: a finished row
                    continue
                r.token_ids.append(tok)
                r.logprobs.append(lp)
                r.versions.append(version)
                if tok in stops[i]:
                    r.finish_reason = "stop"
                elif len(r.token_ids) >= r.request.params.max_new_tokens:
                    r.finish_reason = "length"
                finished_now |= r.finish_reason is not None
            self.stats["decode_steps"] += 1
            self.stats["row_steps"] += len(rows)
            seq[:, col] = tokens
            col += 1
            if finished_now:
                self._finish_calls()
                alive = [i for i, r in enumerate(rows) if r.finish_reason is None]
                if not alive:
                    return
                if self.compact:  # finished rows leave the batch: they stop costing compute
                    idx = torch.tensor(alive, device=dev)
                    rows = [rows[i] for i in alive]
                    stops = [stops[i] for i in alive]
                    seq, mask, tokens, pos = seq[idx], mask[idx], tokens[idx], pos[idx]
                    temperature, top_k, top_p = temperature[idx], top_k[idx], top_p[idx]
                    uniforms = uniforms[idx]
                    cache.keep(idx)
                    self.active = rows
            self._poll()
            if all(r.finish_reason is not None for r in rows):  # aborted
                return
            if self.stale_cache:  # new weights: recompute the keys/values of every prefix
                self.stats["reprefills"] += 1
                remaining = max(
                    r.request.params.max_new_tokens - len(r.token_ids)
                    for r in rows
                    if r.finish_reason is None
                )
                no_padding = bool(mask.all())
                logits, cache, pos = self._prefill(
                    seq[:, :col], mask[:, :col], col + remaining, no_padding
                )
                self.stale_cache = False
                continue
            pos = pos + 1  # the newest token (tokens) sits one position after the previous one
            decode = self.decode if len(rows) > 1 else decode_logits
            # mask: cached + new keys
            logits = decode(self.model, tokens, pos, None if no_padding else mask[:, :col], cache)


def _serve_in_child(spec: dict, inbox: Any, outbox: Any) -> None:
    """Entry point of the engine process: allocate the model, then serve until shutdown.

    The process lives exactly as long as its trainer: it dies with it (SIGKILL included; see
    ``die_with_parent``) and ignores Ctrl-C, which the terminal sends to the whole process group:
    the trainer decides when the engine stops (``shutdown``)."""
    from minippo.parallel.distributed import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid=spec["parent_pid"], prctl=spec["from_main_thread"])
    torch.set_num_threads(spec["num_threads"])
    # oneDNN's primitive cache and ideep's kernel cache keep one entry per (layer, input shape);
    # both read their capacity at first use, which is below
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ[var] = str(spec["onednn_cache_capacity"])
    try:
        server = _Server(inbox=inbox, outbox=outbox, **spec["server"])
    except Exception:
        outbox.put(("error", 0, traceback.format_exc()))
        return
    outbox.put(("ok", 0, "ready"))
    server.serve()


class _SharedBucket:
    """A bucket's tensors copied into one shared-memory buffer per dtype; it pickles as those
    buffers and unpickles in the engine process as the bucket, ``[(name, view of a buffer)]``.

    Each shared storage crosses the process boundary as a file descriptor, handed over through
    a connection of its own: one per dtype instead of one per tensor makes a publish of the tiny
    model ~3x faster (docs/benchmarks.md, "Per-step overhead"). Keep the object alive until the
    engine has applied the bucket."""

    def __init__(self, bucket: WeightBucket) -> None:
        bucket = list(bucket)
        sizes: dict[torch.dtype, int] = {}
        self.layout = []  # (name, dtype, offset, shape)
        for name, t in bucket:
            offset = sizes.get(t.dtype, 0)
            self.layout.append((name, t.dtype, offset, tuple(t.shape)))
            sizes[t.dtype] = offset + t.numel()
        self.buffers = {dt: torch.empty(n, dtype=dt).share_memory_() for dt, n in sizes.items()}
        for (_, dt, offset, _), (_, t) in zip(self.layout, bucket):
            self.buffers[dt][offset : offset + t.numel()].view(t.shape).copy_(t.detach())

    def __reduce__(self):
        return _bucket_views, (self.buffers, self.layout)


def _quiet_dead_peer_handovers() -> None:
    """Keep a dead engine's half-finished handover from printing a traceback (once per process).

    A shared storage crosses to the engine as a file descriptor that a background thread of
    multiprocessing (``resource_sharer``) serves on request. If the engine dies in the middle of
    that exchange, the thread's connection error goes to ``sys.excepthook`` and prints a
    traceback, while the trainer already reports the engine's death in one line (the pending
    publish fails). This hook drops exactly those errors (an ``OSError`` or ``EOFError`` raised
    inside ``resource_sharer``) unless ``MINIPPO_LOG_LEVEL=DEBUG``; everything else goes to the
    previous hook."""
    previous = sys.excepthook
    if getattr(previous, "_minippo_dead_peer_filter", False):
        return

    def hook(etype, value, tb) -> None:
        frames = traceback.extract_tb(tb)
        from_sharer = bool(frames) and frames[0].filename.endswith("resource_sharer.py")
        if from_sharer and issubclass(etype, OSError | EOFError) and not debug():
            return
        previous(etype, value, tb)

    hook._minippo_dead_peer_filter = True
    sys.excepthook = hook


def _bucket_views(buffers: dict, layout: list) -> list[tuple[str, torch.Tensor]]:
    """``_SharedBucket`` unpickled: ``(name, tensor)`` views of the shared buffers."""
    out = []
    for name, dt, offset, shape in layout:
        n = 1
        for d in shape:
            n *= d
        out.append((name, buffers[dt][offset : offset + n].view(shape)))
    return out


# ----------------------------------------------------------------------------------------------
# The parent-side API


class TorchEngine:
    """The embedded rollout engine (implements :class:`~minippo.engine.RolloutEngine`).

    Built from the model config: it allocates its own model (in its process) and holds no valid
    weights until the first :meth:`publish_weights`; ``generate`` refuses until then.

    Args:
        model_args:     the :class:`minippo.models.ModelArgs` of the policy (the trainer's
                        ``model.args``); the recipe passes it.
        dtype:          the engine's compute dtype (config key ``engine.dtype``): "float32" /
                        "fp32", "bfloat16" / "bf16", "float16" / "fp16", or a ``torch.dtype``.
                        Weights, activations and the KV cache are in it; sampling runs in fp32.
        device:         where the engine's model lives (default CPU); "cuda" without an index
                        is this rank's GPU, ``cuda:$LOCAL_RANK`` (:func:`engine_device`).
        version:        the weight version the engine starts at (the first publish may not go
                        below it).
        in_process:     run the serving loop in a thread of this process instead of a spawned
                        process (same code; for tests and debugging).
        num_threads:    torch threads of the engine process (default: half the cores divided
                        by the ranks on this node, at least 1). Ignored in-process.
        max_batch_size: most rows decoded together; more waiting requests form the next wave.
        compact:        drop finished rows from the batch (KVCache.keep). False keeps computing
                        them until the whole wave is done (only useful to measure the gain).
        compile:        ``torch.compile`` the decode step and the sampler of rows without
                        top-k / top-p (config key ``engine.compile``; default False). Compiled
                        at first use in the engine process (tens of seconds on CPU, see
                        docs/benchmarks.md); same logprobs, publishes and sleep / wake unchanged.
        seed:           seeds the per-request seeds of requests without one.
        start_timeout:  seconds to wait for the engine process to allocate its model.
        quantize:       null, "fp8", "int8" or "int4" (config key ``engine.quantize``):
                        sample from linear layers rounded as a quantized serving engine would
                        (:mod:`minippo.engine.quantize`: FP8 E4M3 weights per channel and
                        activations per token, int8 weights per channel, or int4 weights per
                        group of 32), while the trainer scores in
                        its own precision. For studying the train-inference gap; the output
                        layer, embeddings and norms are not rounded.
        onednn_cache_capacity: entries of the engine process's oneDNN primitive cache and
                        ideep kernel cache (config key ``engine.onednn_cache_capacity``; default
                        1024, oneDNN's own). Each holds one kernel per (linear layer, input
                        shape): responses of varied length give many batch shapes, and the
                        caches then grow by hundreds of MB (docs/benchmarks.md, "Kernel cache").
                        Ignored in-process (the trainer's process keeps its own settings).
    """

    def __init__(
        self,
        model_args: ModelArgs,
        *,
        dtype: str | torch.dtype = "float32",
        device: torch.device | str = "cpu",
        version: int = 0,
        in_process: bool = False,
        num_threads: int | None = None,
        max_batch_size: int = 256,
        compact: bool = True,
        compile: bool = False,
        seed: int = 0,
        start_timeout: float = 300.0,
        quantize: str | None = None,
        onednn_cache_capacity: int = 1024,
    ) -> None:
        if not isinstance(model_args, ModelArgs):
            raise TypeError(
                f"TorchEngine is built from the model config (minippo.models.ModelArgs, e.g. "
                f"model.args), got {type(model_args).__name__}; its weights come from "
                "publish_weights"
            )
        if max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {max_batch_size}")
        if isinstance(onednn_cache_capacity, bool) or not (
            isinstance(onednn_cache_capacity, int) and onednn_cache_capacity >= 1
        ):
            raise ValueError(
                f"engine.onednn_cache_capacity must be an integer >= 1, got "
                f"{onednn_cache_capacity!r}"
            )
        check_quant_format(quantize)
        if not isinstance(compile, bool):
            raise TypeError(f"engine.compile must be true or false, got {compile!r}")
        self.args = model_args
        self.max_seq_len = int(model_args.max_seq_len)
        self.max_batch_size = int(max_batch_size)  # rows per decode wave
        self.in_process = in_process
        self._dtype = compute_dtype(dtype)
        self._version = int(version)
        self._has_weights = False  # until the first publish succeeds
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}  # call id -> the reply
        self._lock = threading.Lock()  # guards _pending and message sends
        self._control = threading.Lock()  # one control operation (publish/pause/...) at a time
        # the last publish (call id, reply, version) until its reply is read
        self._publishing: tuple[int, Future, int] | None = None
        self._closed = False
        self._process = None
        server_kw = dict(
            model_args=model_args,
            device=engine_device(device),
            dtype=self._dtype,
            version=self._version,
            seed=seed,
            max_batch_size=max_batch_size,
            compact=compact,
            quantize=quantize,
            compile=compile,
        )
        if in_process:
            self._inbox: Any = queue_lib.Queue()
            self._outbox: Any = queue_lib.Queue()
            server = _Server(inbox=self._inbox, outbox=self._outbox, **server_kw)
            self._server_thread = threading.Thread(
                target=server.serve, name="torch-engine", daemon=True
            )
            self._server_thread.start()
        else:
            _quiet_dead_peer_handovers()
            ctx = mp.get_context("spawn")
            self._inbox = ctx.Queue()
            self._outbox = ctx.Queue()
            spec = {
                "num_threads": num_threads or default_num_threads(),
                "onednn_cache_capacity": onednn_cache_capacity,
                "server": server_kw,
                "parent_pid": os.getpid(),
                # the kernel's parent-death signal follows the thread that starts the process
                "from_main_thread": threading.current_thread() is threading.main_thread(),
            }
            self._process = ctx.Process(
                target=_serve_in_child, args=(spec, self._inbox, self._outbox), daemon=True
            )
            from minippo.training.interrupt import children_ignore_sigint

            with children_ignore_sigint():  # the trainer stops it, not a Ctrl-C at the terminal
                self._process.start()
            status, _, result = self._read(timeout=start_timeout)
            if status != "ok" or result != "ready":
                self._process.kill()
                raise RuntimeError(f"the engine process failed to start:\n{result}")
        self._reader = threading.Thread(
            target=self._read_replies, name="engine-replies", daemon=True
        )
        self._reader.start()
        # safety net at interpreter exit or garbage collection (shutdown() is the normal path)
        self._finalizer = weakref.finalize(self, _shutdown_quietly, self._inbox, self._process)

    # -- protocol --------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def dtype(self) -> torch.dtype:
        """The engine's compute dtype (publish weights cast to it)."""
        return self._dtype

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete ``requests`` (validated first); blocks; thread-safe."""
        requests = list(requests)
        validate_requests(requests, max_seq_len=self.max_seq_len, vocab_size=self.args.vocab_size)
        if not self._has_weights:
            raise RuntimeError(
                "no weights published yet: TorchEngine is built empty from the model config; "
                "call publish_weights(...) before generate"
            )
        self._raise_if_publish_failed()
        if not requests:
            return []
        return self._call("generate", requests)

    def stream(
        self, requests: Sequence[GenerateRequest], *, until_groups: int | None = None
    ) -> Iterator[Completion]:
        """Yield completions as they finish; with ``until_groups=k``, the engine stops the call's
        other requests after the decode step that completed the ``k``-th group and yields them
        last as partial completions (the protocol's "Streaming groups"). Validated before
        anything is sent; closing the iterator early stops what is left of the call."""
        requests = list(requests)
        validate_requests(requests, max_seq_len=self.max_seq_len, vocab_size=self.args.vocab_size)
        GroupCounter(requests, until_groups)  # checks until_groups
        if not self._has_weights:
            raise RuntimeError(
                "no weights published yet: TorchEngine is built empty from the model config; "
                "call publish_weights(...) before stream"
            )
        self._raise_if_publish_failed()
        return self._stream(requests, until_groups) if requests else iter(())

    def _stream(self, requests: list[GenerateRequest], until_groups: int | None):
        cid, parts = self._open_call(queue_lib.Queue())
        self._send("stream", cid, (requests, until_groups))
        ended = False
        try:
            while True:
                status, result = self._next_part(cid, parts)
                if status == "ok":
                    ended = True
                    return
                yield from result
        finally:
            if not ended and not self._closed:
                with contextlib.suppress(Exception):
                    self._call("stream_cancel", cid)
            with self._lock:
                self._pending.pop(cid, None)

    def _next_part(self, cid: int, parts: queue_lib.Queue) -> tuple[str, Any]:
        """The next message of stream ``cid``; raises if the engine fails or dies."""
        while True:
            try:
                status, result = parts.get(timeout=1.0)
            except queue_lib.Empty:
                if self._process is not None and not self._process.is_alive():
                    code = self._process.exitcode
                    raise RuntimeError(f"the engine process died (exit code {code})") from None
                if self._closed:
                    raise RuntimeError("the engine was shut down") from None
                continue
            if status == "error":
                raise RuntimeError(f"engine error:\n{result}")
            return status, result

    def publish_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy (HF or native name, tensor) buckets into the engine's weights; stamp ``version``.

        Returns once the buckets are copied and sent, before the engine has applied them: the
        engine applies them between two decode steps (in-flight rows then re-prefill under the
        new weights), before any request or control call made after this one, so ``version`` is
        the new one at once. The buckets' tensors may change as soon as this returns. A publish
        that fails (a bad name or shape) fails the running generate / stream calls and the next
        call of this engine (``publish_weights``, ``pause``, ``generate``...) raises its error;
        the engine refuses to generate until a publish succeeds. ``wait_published()`` waits for
        the engine to have applied the last publish.
        The first publish must send every parameter (the tied lm_head excepted).
        """
        version = int(version)
        if version < self._version:
            raise ValueError(
                f"version must not decrease: got {version}, engine has {self._version}"
            )
        with self._control:
            self._settle_publish()
            cid, reply = self._open_call()
            self._send("publish_begin", cid, version)
            keep = []  # the sent copies stay alive until the engine has applied them
            try:
                for bucket in buckets:
                    if self.in_process:  # the engine thread reads them later: copies
                        sent = [(n, t.detach().clone()) for n, t in bucket]
                    else:
                        sent = _SharedBucket(bucket)
                    keep.append(sent)
                    self._send("publish_bucket", cid, sent)
            finally:
                self._send("publish_end", cid, None)
            reply.add_done_callback(lambda _: keep.clear())
            self._publishing = (cid, reply, version)
            self._version = version
            self._has_weights = True

    def wait_published(self) -> None:
        """Return once the engine has applied the last ``publish_weights``; raise its error if
        it failed."""
        with self._control:
            self._settle_publish()

    def _settle_publish(self) -> None:
        """Wait for the last publish's reply (under ``_control``); raise if it failed."""
        if self._publishing is None:
            return
        cid, reply, version = self._publishing
        self._publishing = None
        try:
            self._wait(cid, reply)
        except RuntimeError as e:
            raise RuntimeError(_publish_error(version, e)) from None

    def _raise_if_publish_failed(self) -> None:
        """Without waiting: raise the last publish's error if its reply has come and says so
        (once: the next call does not raise it again)."""
        publishing = self._publishing
        if publishing is None or not publishing[1].done() or publishing[1].exception() is None:
            return
        with self._lock:
            if self._publishing is publishing:
                self._publishing = None
            self._pending.pop(publishing[0], None)
        raise RuntimeError(_publish_error(publishing[2], publishing[1].exception()))

    def pause(self) -> None:
        """Returns once no forward pass runs; in-flight requests keep their state."""
        with self._control:
            self._settle_publish()
            self._call("pause", None)

    def resume(self) -> None:
        with self._control:
            self._settle_publish()
            self._call("resume", None)

    def abort(self) -> list[Completion]:
        """Stop every in-flight and waiting request; return their partial completions."""
        with self._control:
            self._settle_publish()
            return self._call("abort", None)

    def sleep(self) -> None:
        """Move the weights off the accelerator (no-op on CPU); needs an idle engine."""
        with self._control:
            self._settle_publish()
            self._call("sleep", None)

    def wake(self) -> None:
        with self._control:
            self._settle_publish()
            self._call("wake", None)

    def stats(self) -> dict[str, int | str | bool]:
        """Counters: waves, decode_steps, row_steps (rows summed over steps), reprefills; and
        ``linear_kernel``: ``"onednn_packed"`` (CPU, float32 / bfloat16, weights packed once per
        publish) or ``"torch"`` (the model's own ``nn.Linear`` layers); ``compiled``: the
        ``compile`` option; ``onednn_cache_capacity``: the kernel caches' capacity as the
        engine process set it (its environment's value in-process, None if unset);
        ``cuda_allocated_bytes`` / ``cuda_reserved_bytes`` (now) and ``cuda_peak_allocated_bytes``
        / ``cuda_peak_reserved_bytes`` (since the last ``wake``, or the start): the engine
        process's CUDA caching allocator on a CUDA device (after ``sleep`` both "now" figures
        should be about 0), None elsewhere. In-process these are the whole process's figures,
        and a wake resets the process's peaks."""
        return self._call("stats", None)

    def shutdown(self) -> None:
        """Abort what runs, stop the serving loop and the process; idempotent."""
        if self._closed:
            return
        with contextlib.suppress(Exception):  # a dead engine process cannot answer
            self._call("shutdown", None, timeout=30)
        self._closed = True
        if self._process is not None:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=10)
        else:
            self._server_thread.join(timeout=30)
        self._reader.join(timeout=5)
        self._finalizer.detach()
        with self._lock:
            for reply in self._pending.values():
                if isinstance(reply, queue_lib.Queue):
                    reply.put(("error", "the engine was shut down"))
                elif not reply.done():
                    reply.set_exception(RuntimeError("the engine was shut down"))

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- messaging ---------------------------------------------------------------------------------
    def _open_call(self, reply: Future | queue_lib.Queue | None = None) -> tuple[int, Any]:
        """A new call id and where its reply lands: a Future, or a Queue for a stream's parts."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        reply = Future() if reply is None else reply
        with self._lock:
            cid = next(self._ids)
            self._pending[cid] = reply
        return cid, reply

    def _send(self, kind: str, cid: int, payload: Any) -> None:
        with self._lock:
            self._inbox.put((kind, cid, payload))

    def _call(self, kind: str, payload: Any, timeout: float | None = None) -> Any:
        cid, reply = self._open_call()
        self._send(kind, cid, payload)
        return self._wait(cid, reply, timeout)

    def _wait(self, cid: int, reply: Future, timeout: float | None = None) -> Any:
        """The reply's result; raises if the engine process dies or ``timeout`` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    return reply.result(timeout=1.0)
                except FutureTimeout:
                    if self._process is not None and not self._process.is_alive():
                        code = self._process.exitcode
                        raise RuntimeError(f"the engine process died (exit code {code})") from None
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"engine call {cid} timed out after {timeout} s"
                        ) from None
        finally:
            with self._lock:
                self._pending.pop(cid, None)

    def _read(self, timeout: float | None = None) -> tuple:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._outbox.get(timeout=1.0)
            except queue_lib.Empty:
                if self._process is not None and not self._process.is_alive():
                    return ("error", 0, f"exit code {self._process.exitcode}")
                if deadline is not None and time.monotonic() > deadline:
                    return ("error", 0, f"no reply within {timeout} s")

    def _read_replies(self) -> None:
        while True:
            try:
                status, cid, result = self._outbox.get(timeout=1.0)
            except queue_lib.Empty:
                if self._process is not None and not self._process.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            if cid == -1:  # the server's closing reply
                return
            with self._lock:
                reply = self._pending.get(cid)
                if isinstance(reply, queue_lib.Queue):  # a stream: its parts, then the end
                    reply.put((status, result))
                    continue
                if reply is None or reply.done():
                    continue
                if status == "error":
                    reply.set_exception(RuntimeError(f"engine error:\n{result}"))
                else:
                    reply.set_result(result)


def _publish_error(version: int, error: BaseException | None) -> str:
    """One line for a failed publish: the engine's exception (the last line of its traceback)."""
    last = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    return f"the publish_weights of version {version} failed: {last}"


def _shutdown_quietly(inbox: Any, process: Any) -> None:
    """atexit / garbage-collection safety net: stop the engine process if still running."""
    with contextlib.suppress(Exception):
        inbox.put(("shutdown", 0, None))
    if process is not None:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
