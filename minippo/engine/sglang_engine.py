"""SGLangEngine: the GPU rollout engine, one SGLang engine (tp=1) per training rank.

Each torchrun rank owns one SGLang ``Engine`` on its own GPU (``base_gpu_id = local_rank``). The
engine's scheduler and detokenizer run in child processes, so generation overlaps training; the
tokenizer manager runs in the rank's own process and is driven from here. Written against
sglang==0.5.23 (``SGLANG_VERSION``); SGLang is imported lazily, only when an engine is built.

Threading. SGLang's synchronous ``Engine`` methods run ``loop.run_until_complete`` on the engine's
own asyncio loop, so two of them can never run at once (one blocking ``generate`` would stall
``publish`` and ``pause``) and none may be called from a running event loop. This backend therefore
never calls them: it starts one thread that runs the engine's loop forever, and every protocol
method submits a coroutine of the tokenizer manager's async API to that loop
(``asyncio.run_coroutine_threadsafe``) and blocks on the result. ``generate`` may be called from the
rollout queue's background thread while ``publish_weights`` / ``pause`` / ``resume`` / ``abort``
come from the main thread; the coroutines interleave on the one loop and share state only there.
The protocol methods are blocking: never call them from inside a running event loop (they raise).

Streams (``stream(requests, until_groups=k)``). Each request is one task on the engine loop (as in
``generate``); each completion is handed to the calling thread through a thread-safe queue the
moment its task ends, so the caller sees them in finishing order. Once ``k`` groups have every
request finished (``GroupCounter``; a request ended by an abort does not count), the call's other
requests are stopped: those still waiting at the backend's gate end as empty aborts, the ones in
SGLang are aborted one by one with the tokenizer manager's ``abort_request(rid=...)`` (sent once
per request: SGLang ignores a repeated abort of the same rid); each returns its partial output,
with per-token versions checked as for any response, and they are yielded last in request order.
SGLang matches an aborted rid as a prefix of its requests' rids, so the backend's rids are
prefix-free (``"<counter>#<request_id>"``). Closing the iterator early (``close()``, or dropping
it after a ``break``) aborts the call's requests in the same way and waits until they have ended
(while paused only a moment: the retracted requests answer their abort at once).

Weight versions, per token. SGLang 0.5.23 tracks them itself: when the weight version changes
(here: ``update_weight_version`` at the end of each publish), the scheduler appends, for every live
request that has output tokens, an event ``(old_version, number of output tokens so far)``; a
finished request reports ``meta_info["weight_versions"]``, spans ``{version, start, end}`` over its
output tokens (``meta_info["weight_version"]`` alone is the version at return time, which is wrong
for a response that spanned a publish). The version only changes while no token can be sampled —
either generation is paused (``pause()``: in-flight requests are retracted, their token count is
final until ``resume()``), or this backend has drained every in-flight request first (a publish
without a pause) — so the count recorded at the change is exactly the number of tokens sampled
under the old version: token ``i`` carries the version of the span that contains ``i``. The backend
checks each response's spans: contiguous, covering every token, non-decreasing, and between the
version current when the request was admitted and the newest published version.

Logprobs. ``meta_info["output_token_logprobs"]`` holds ``(logprob, token_id, None)`` per output
token: ``log_softmax(logits / T)`` over the full vocabulary at the request's temperature (after
penalties / logit bias, which minippo never sets), not renormalised for top-k / top-p; for greedy
requests (``T == 0``; SGLang turns them into ``T = 1, top_k = 1``) it is ``log_softmax(logits)``.
This is minippo's definition (``minippo.models.token_logprobs(..., temperature=T)``). The
environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` would switch SGLang to T = 1 logprobs; the
constructor refuses it.

Publishing (``publish_weights(buckets, version)``): on every rank, the trainer walks its FSDP2
parameters in the same order (``minippo.parallel.full_tensor_buckets``: the gathers are
collectives) and hands the buckets over; for each bucket this backend casts the tensors to the
engine dtype on the local GPU, serialises them as CUDA IPC handles and loads them with the
tokenizer manager's ``update_weights_from_tensor(load_format=None, flush_cache=False)`` inside one
``begin_weight_update`` / ``end_weight_update`` session (0.5.23 rejects the load outside a
session), drops its references and calls ``torch.cuda.ipc_collect()``; once more after the last
bucket; then ``flush_cache`` and ``update_weight_version(str(version))``. The buckets are iterated in
the calling thread (the gathers need the trainer's process group and stream). Without a ``pause()``
the publish first closes the gate to new requests and waits until the running ones finish (SGLang
would wait for them anyway and must not start a request between two buckets). ``Engine``'s own
``update_weights_from_tensor`` is the same call made through ``run_until_complete`` (which cannot
be used while the loop runs in our thread) and cannot stamp a version.

Seeds (``enable_deterministic_inference``). SGLang uses a request's ``sampling_seed`` only with
``enable_deterministic_inference`` (which also forces its pytorch sampling backend and
batch-invariant kernels); otherwise it drops the seed silently. So the backend sends seeds only
in that mode (``honours_seeds``), where it also draws a seed for every sampled request that has
none (SGLang would give them all the seed 42, i.e. identical samples of the same prompt). Without
it, sampling is not reproducible, whatever the request's seed.

Engine death. Any exception in SGLang's scheduler is fatal to the rank (see
``minippo.engine._sglang_process``): the backend installs its own SIGQUIT handler through SGLang's
``custom_sigquit_handler``, which writes one line naming the rank and the call in progress and
raises :class:`SGLangEngineDied`, instead of SGLang's SIGKILL of the whole process tree. Before
any weight reaches the engine, every published name and shape is checked against the engine's
model config (``config.json`` of ``model_path``, and ``model_args`` against it at construction):
SGLang would die on a wrong shape and silently keep random weights for a misspelt name. Every
call into the tokenizer manager has a timeout (``call_timeout_s``) with a message naming the call.

Memory modes (``memory_mode``):
    * ``overlap``: engine and trainer share the GPU at the same time (``mem_fraction_static`` of
      it is the engine's); ``sleep()`` / ``wake()`` do nothing.
    * ``sleep``: the engine releases its memory while the trainer trains. ``sleep()`` (engine idle)
      releases weights, KV cache and CUDA graphs; ``wake()`` restores only the weights' memory
      (their values are undefined unless ``weights_cpu_backup``, which restores everything);
      ``publish_weights`` pushes the buckets and flushes, and leaves the KV cache and CUDA
      graphs released, so the trainer can offload its own state between publishing and
      generating; the first ``generate`` / ``stream`` afterwards returns the trainer's cached CUDA
      blocks to the driver and restores KV cache and CUDA graphs before it admits a request.
      Sequence: ``wake -> publish_weights -> [trainer offloads] -> generate / stream (KV restored
      here) ... -> sleep``. Generating between ``wake`` and ``publish_weights`` raises.

Process side effects of SGLang's ``Engine`` (documented in docs/sglang_backend.md): creating it sets
the multiprocessing start method to ``spawn`` and some NCCL environment variables in this process,
installs uvloop's event-loop policy, and its ``shutdown()`` kills EVERY child process of this
process (not only SGLang's): this backend's ``shutdown()`` narrows that kill to the engine's own
processes (``_stop_engine``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import multiprocessing
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed.tensor import DTensor

from minippo.engine._sglang_process import (
    SGLangEngineDied,
    check_environment,
    cpu_launch_environment,
    engine_launch_environment,
    expected_hf_shapes,
    gpu_kernel_import_warnings_ignored,
    logging_kept,
    on_engine_death,
    register_engine,
    shape_mismatches,
    unregister_engine,
    use_device,
)
from minippo.engine.protocol import (
    FINISH_REASONS,
    Completion,
    GenerateRequest,
    GroupCounter,
    SamplingParams,
    WeightBucket,
    compute_dtype,
    settled_finish_reason,
    validate_requests,
)

if TYPE_CHECKING:
    from minippo.models import ModelArgs

__all__ = [
    "SGLANG_VERSION",
    "SGLangEngine",
    "SGLangEngineDied",
    "check_environment",
    "engine_launch_environment",
    "prepare_bucket",
    "serialize_bucket",
]

SGLANG_VERSION = "0.5.23"
# flush_cache after a weight update or before a release succeeds only when the scheduler is fully
# idle; its overlap loop keeps the last batch for about one iteration after the last output
FLUSH_ATTEMPTS = 60
FLUSH_RETRY_S = 1.0

MemoryMode = Literal["overlap", "sleep"]
MEMORY_MODES: tuple[str, ...] = ("overlap", "sleep")
DEVICES: tuple[str, ...] = ("cuda", "cpu")
# SGLang's own limits stop short of its context_len: max_req_len = context_len - 1, max_new is
# capped at max_req_len - input - 1, and an input of context_len - 6 tokens or more is rejected
# with an abort that async_generate raises (managers/utils.py ~272-287). The backend validates
# requests against the user's context and gives SGLang this many tokens more.
CONTEXT_SLACK = 8
CPU_MAX_TOTAL_TOKENS = 65536  # the KV pool of a CPU engine (SGLang would size it from host memory)
# SGLang's memory tags (release / resume occupation)
_MEM_WEIGHTS, _MEM_KV, _MEM_GRAPH = "weights", "kv_cache", "cuda_graph"


def _load_sglang_api() -> SimpleNamespace:
    """Import the SGLang names the backend uses (lazily: SGLang needs CUDA torch).

    tests/sglang_api.py lists every piece of SGLang's API this module uses (these imports, the
    methods, keywords and output keys) and tests/unit/test_sglang_api_compat.py checks it against
    the pinned wheel's source and against this module's own calls."""
    with gpu_kernel_import_warnings_ignored():
        try:
            from sglang.srt.entrypoints.engine import Engine, kill_process_tree
            from sglang.srt.managers.io_struct import (
                BeginWeightUpdateReqInput,
                ContinueGenerationReqInput,
                EndWeightUpdateReqInput,
                PauseGenerationReqInput,
                ReleaseMemoryOccupationReqInput,
                ResumeMemoryOccupationReqInput,
                UpdateWeightsFromTensorReqInput,
                UpdateWeightVersionReqInput,
            )
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError as e:
            raise ImportError(
                f"SGLangEngine needs sglang=={SGLANG_VERSION} on a CUDA machine "
                f'(pip install "minippo[sglang]"); importing it failed: {e}'
            ) from e
    return SimpleNamespace(
        Engine=Engine,
        kill_process_tree=kill_process_tree,
        MultiprocessingSerializer=MultiprocessingSerializer,
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


def _bind_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (None: nothing to do)."""
    if device is not None:
        torch.cuda.set_device(device)


def _cuda_ipc_collect() -> None:
    """Free the CUDA IPC handles the engine process no longer uses (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def _cuda_release_cache() -> None:
    """Return this process's cached CUDA blocks to the driver (after ``ipc_collect``), so that
    the engine can map its memory back (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def prepare_bucket(
    bucket: WeightBucket,
    index: int,
    *,
    expected: Mapping[str, tuple[int, ...]],
    seen: set[str],
    device: torch.device | None,
    dtype: torch.dtype,
    model_path: str,
) -> list[tuple[str, torch.Tensor]]:
    """Check one bucket's names and shapes against the engine's model and cast it for sending.

    Every ``(hf_name, full tensor)`` must be a weight of ``expected`` (``{HF name: shape}``) with
    that shape, published once (``seen`` collects the names over a publish); otherwise ValueError
    listing the mismatches, before anything is sent. Returns the tensors cast to ``dtype`` on
    ``device`` (the engine's GPU; None: where they are).
    """
    named, problems = [], []
    for item in bucket:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"bucket {index}: expected (hf_name, tensor) pairs, got {item!r}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
            raise TypeError(
                f"bucket {index}: {name} is a {type(tensor).__name__}; publish_weights needs "
                "full tensors (DTensor.full_tensor(), as minippo.parallel.full_tensor_buckets "
                "gives)"
            )
        shape = expected.get(name)
        if shape is None:
            problems.append(f"{name} is not a weight of the engine's model")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the engine's is {shape}")
        elif name in seen:
            problems.append(f"{name} is published twice")
        seen.add(name)
        t = tensor.detach()
        t = t.to(dtype=dtype) if device is None else t.to(device, dtype)
        named.append((name, t))
    if problems:
        raise ValueError(
            f"publish_weights: bucket {index} does not match the engine's model "
            f"({model_path}/config.json), nothing of it was sent: {'; '.join(problems[:8])}"
            f"{f'; and {len(problems) - 8} more' if len(problems) > 8 else ''}"
        )
    if not named:
        raise ValueError(f"bucket {index} is empty")
    return named


def serialize_bucket(
    api: Any, named: list[tuple[str, torch.Tensor]], *, cuda: bool = True
) -> bytes:
    """One bucket as SGLang's ``update_weights_from_tensor`` payload for a tp=1 engine.

    ``MultiprocessingSerializer.serialize`` pickles each CUDA tensor as an IPC handle. For CUDA
    tensors SGLang's producer-side ``monkey_patch_torch_reductions`` is applied first (once per
    process; what sglang's own ``weight_sync`` helper and slime do): the handle then carries the
    GPU's UUID instead of this process's device index, which the scheduler maps back to its own
    index, so it stays right when the two processes see the GPUs under different indices
    (``CUDA_VISIBLE_DEVICES`` per rank, ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS``). The patch is
    process-wide and handles CUDA tensors only: afterwards ``ForkingPickler`` cannot pickle CPU
    tensors in this process (an IndexError inside SGLang's reduction). So the bucket of an engine
    on the CPU (``cuda=False``) is serialised without it: its storages travel as shared memory.
    """
    if cuda:
        api.monkey_patch_torch_reductions()
    return api.MultiprocessingSerializer.serialize(obj=named)


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested on CPU)


def engine_ports(base_port: int, local_rank: int, port_stride: int) -> tuple[int, int]:
    """``(port, nccl_port)`` of the engine of ``local_rank``.

    port = base_port + local_rank * port_stride,  nccl_port = port + 1.
    ``port`` is SGLang's server port, which an engine started in-process never binds (its own
    messages go through ipc:// files); its scheduler listens on ``nccl_port``. Each rank's engine
    needs its own pair.
    """
    if port_stride < 2:
        raise ValueError(
            f"port_stride ({port_stride}) must be >= 2: each engine uses port and port + 1"
        )
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    port = base_port + local_rank * port_stride
    if base_port < 1024 or port + 1 > 65535:
        raise ValueError(
            f"engine ports {port}, {port + 1} (base_port={base_port}, local_rank={local_rank}, "
            f"port_stride={port_stride}) must lie in [1024, 65535]; lower base_port"
        )
    return port, port + 1


def engine_server_args(
    *,
    model_path: str,
    local_rank: int,
    port: int,
    nccl_port: int,
    mem_fraction_static: float,
    dtype: str,
    load_format: str,
    memory_mode: str,
    weights_cpu_backup: bool,
    random_seed: int,
    version: int,
    context_length: int,
    sampling_backend: str | None,
    enable_deterministic_inference: bool,
    rl_on_policy_target: str | None,
    log_level: str,
    device: str = "cuda",
    max_total_tokens: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine(**kwargs)`` (= ``ServerArgs`` fields); the same
    keys on every device.

    tp_size=1 on GPU ``local_rank`` (``base_gpu_id`` indexes the visible GPUs); token ids in and
    out (``skip_tokenizer_init``); the memory saver only in ``sleep`` mode (release/resume need it);
    SGLang installs ``on_engine_death`` as this process's SIGQUIT handler instead of its own
    (which SIGKILLs the process tree) when a scheduler fails. ``context_length`` is what SGLang
    gets: the backend passes the user's context plus :data:`CONTEXT_SLACK`.

    ``device="cpu"`` (the real engine on a CPU, docs/sglang_backend.md): SGLang's plain-torch
    attention (``torch_native``) and sampler (``pytorch``), no CUDA graphs, and ``base_gpu_id`` 0
    on every rank (SGLang takes it for a NUMA node index there; one node serves them all).
    """
    cpu = device == "cpu"
    return dict(
        model_path=model_path,
        tp_size=1,
        base_gpu_id=0 if cpu else local_rank,
        port=port,
        nccl_port=nccl_port,
        mem_fraction_static=mem_fraction_static,
        dtype=dtype,
        load_format=load_format,
        skip_tokenizer_init=True,
        enable_memory_saver=memory_mode == "sleep",
        enable_weights_cpu_backup=weights_cpu_backup,
        random_seed=random_seed,
        weight_version=str(version),
        context_length=context_length,
        sampling_backend="pytorch" if cpu and sampling_backend is None else sampling_backend,
        enable_deterministic_inference=enable_deterministic_inference,
        rl_on_policy_target=rl_on_policy_target,
        log_level=log_level,
        custom_sigquit_handler=on_engine_death,
        device=device,
        attention_backend="torch_native" if cpu else None,
        disable_cuda_graph=cpu,
        max_total_tokens=max_total_tokens,
    )


def check_port_free(port: int, *, base_port: int, local_rank: int) -> None:
    """Refuse a ``nccl_port`` another process listens on (another engine or job on this machine):
    SGLang's scheduler would fail to bind it at start, which is fatal to the rank."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as the scheduler's listener binds it: a closed connection still in TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise ValueError(
                f"engine port {port} (nccl_port of local_rank {local_rank}, engine.base_port="
                f"{base_port}) is in use on this machine ({e.strerror}): another SGLang engine or "
                "job holds it; set engine.base_port to a free range"
            ) from None


def sglang_sampling_params(params: SamplingParams, *, send_seed: bool) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for one request.

    top_k 0 (off) -> -1 (SGLang's "whole vocabulary"); temperature 0 is greedy in both.
    Stop ids: SGLang always also stops at the model's EOS ids (config.json /
    generation_config.json) unless ``ignore_eos``, which also disables ``stop_token_ids``. So a
    request without stop ids gets ``ignore_eos=True`` (no stop at all, as the protocol says);
    one with stop ids stops at them AND at the model's EOS ids. The seed becomes
    ``sampling_seed`` only with ``send_seed`` (SGLang ignores it unless the engine runs with
    ``enable_deterministic_inference``) and never for greedy requests.
    """
    sp: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "max_new_tokens": int(params.max_new_tokens),
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    else:
        sp["ignore_eos"] = True
    if send_seed and params.seed is not None and params.temperature > 0:
        sp["sampling_seed"] = int(params.seed)
    return sp


def _parse_version(value: Any, where: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise RuntimeError(
            f"{where}: engine weight version {value!r} is not an integer; the engine must be "
            "started and updated by SGLangEngine (which stamps str(version))"
        ) from None


def token_versions(meta: Mapping[str, Any], n: int, *, low: int, high: int) -> list[int]:
    """Per-token weight versions (length n) from one response's ``meta_info``.

    ``meta["weight_versions"]``: spans ``{"version": str, "start": int, "end": int}`` over the
    output tokens; token i gets the version of the span with start <= i < end. The spans must be
    contiguous from 0 to n, non-decreasing, with low <= version <= high (low = the version when
    the request was admitted, high = the newest version stamped). Without spans (not expected from
    0.5.23) the single ``meta["weight_version"]`` is only accepted when low == high, i.e. when no
    publish happened while the request was in flight; otherwise the versions are unknowable and
    this raises.
    """
    spans = meta.get("weight_versions")
    if spans is None:
        v = _parse_version(meta.get("weight_version"), "weight_version")
        if low != high or v != low:
            raise RuntimeError(
                f"the response has no per-token weight_versions and its versions cannot be "
                f"attributed: it was in flight over versions {low}..{high} (engine says {v})"
            )
        return [v] * n
    versions: list[int] = []
    prev = low
    for span in spans:
        v = _parse_version(span["version"], "weight_versions")
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise RuntimeError(f"weight_versions spans are not contiguous: {list(spans)}")
        if not (prev <= v <= high):
            raise RuntimeError(
                f"weight_versions {list(spans)}: version {v} outside [{prev}, {high}] (admitted "
                f"at {low}; versions must not decrease)"
            )
        prev = v
        versions.extend([v] * (end - start))
    if len(versions) != n:
        raise RuntimeError(f"weight_versions spans cover {len(versions)} tokens, expected {n}")
    return versions


def completion_from_output(
    request: GenerateRequest,
    out: Mapping[str, Any],
    *,
    low: int,
    high: int,
    eos_ids: Iterable[int] = (),
) -> Completion:
    """Turn one SGLang response dict into a Completion (checking its shape on the way; an abort
    that finished the sample is labelled as finished: :func:`settled_finish_reason`)."""
    token_ids = [int(t) for t in out["output_ids"]]
    meta = out["meta_info"]
    n = len(token_ids)
    triples = meta.get("output_token_logprobs")
    if triples is None:
        if n:
            raise RuntimeError(
                f"request {request.request_id!r}: the engine returned {n} tokens without "
                "output_token_logprobs (was return_logprob dropped?)"
            )
        triples = []
    if len(triples) != n:
        raise RuntimeError(
            f"request {request.request_id!r}: {len(triples)} logprobs for {n} output tokens"
        )
    logprobs = []
    for i, (logprob, token_id, _text) in enumerate(triples):
        if int(token_id) != token_ids[i]:
            raise RuntimeError(
                f"request {request.request_id!r}: logprob {i} is for token {token_id}, the "
                f"output token is {token_ids[i]}"
            )
        logprobs.append(float(logprob))
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, Mapping) else None
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"request {request.request_id!r}: unexpected finish_reason {finish!r}")
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        versions=token_versions(meta, n, low=low, high=high),
        finish_reason=settled_finish_reason(reason, token_ids, request.params, eos_ids),
    )


def _empty_abort(request: GenerateRequest) -> Completion:
    return Completion(request.request_id, list(request.prompt_ids), [], [], [], "abort")


def engine_rid(counter: int, request_id: str) -> str:
    """The rid SGLang sees for one request: ``"<counter>#<request_id>"``.

    SGLang aborts every request whose rid starts with the aborted one, so the rids in flight must
    be prefix-free: the counter is unique per engine and ends at the first ``#``, hence one rid
    can only start with another if their counters are equal."""
    return f"{counter}#{request_id}"


@dataclasses.dataclass(eq=False)
class _StreamCall:
    """Loop-side state of one ``stream`` call (touched only on the engine loop, except ``out``).

    Fields:
        requests: the call's requests (index = position in the call).
        counter:  when to stop the others (``GroupCounter``).
        out:      thread-safe queue to the calling thread: ``("part", Completion)``, then
                  ``("end", None)``; or ``("error", exception)``.
        tasks:    one engine-loop task per request.
        rids:     index -> SGLang rid, once the request is admitted into SGLang.
        held:     completions that ended after the stop, yielded last in request order.
        aborted:  rids whose per-request abort was sent (SGLang ignores a second one).
        stopper:  the task that stops the others once ``counter`` says so.
        left:     requests whose task has not ended yet.
        stopping: the call stops its other requests (``until_groups`` reached, or closed).
        closed:   the caller is gone: completions are dropped.
    """

    requests: list[GenerateRequest]
    counter: GroupCounter
    out: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)
    rids: dict[int, str] = dataclasses.field(default_factory=dict)
    held: dict[int, Completion] = dataclasses.field(default_factory=dict)
    aborted: set[str] = dataclasses.field(default_factory=set)
    stopper: asyncio.Task | None = None
    left: int = 0
    stopping: bool = False
    closed: bool = False


# ----------------------------------------------------------------------------------------------
# The engine


class SGLangEngine:
    """Rollout engine backed by one local SGLang engine (tp=1) on this rank's GPU (or on the CPU).

    Build it on every rank (from YAML: ``engine: {_component_:
    minippo.engine.sglang_engine.SGLangEngine, model_path: ..., mem_fraction_static: 0.4}``).

    Args:
        model_path:          local HF checkpoint folder (config.json; with ``load_format="dummy"``
                             only the config is read and the weights come from
                             ``publish_weights``). Published names and shapes are checked
                             against this config. None (``load_format="dummy"`` only): the
                             backend writes the config.json of ``model_args`` into a temporary
                             folder of its own (removed at shutdown).
        model_args:          the trainer's :class:`minippo.models.ModelArgs` (the recipe passes
                             it to every engine); kept as ``self.model_args`` and checked against
                             the engine's config.json at construction (names and shapes).
        device:              "cuda" (one GPU per rank) or "cpu": the real SGLang engine on the
                             CPU (``scripts/sglang_cpu_env.sh`` builds its environment; the backend
                             sets SGLang's CPU switches: ``SGLANG_USE_CPU_ENGINE``, the plain-torch
                             attention and sampler, no CUDA graphs). On the CPU only
                             ``memory_mode="overlap"`` exists (nothing to release).
        mem_fraction_static: fraction of the GPU's memory for the engine's weights + KV cache.
        memory_mode:         "overlap" (share the GPU with the trainer at the same time) or
                             "sleep" (release the engine's memory around training).
        dtype:               the engine's compute dtype (config key ``engine.dtype``): "bfloat16"
                             / "bf16", "float16" / "fp16", "float32" / "fp32", or a
                             ``torch.dtype``; pushed weights are cast to it.
        local_rank:          GPU index among the visible ones; default: $LOCAL_RANK or 0.
        base_port:           ports: port = base_port + local_rank * port_stride, nccl_port =
        port_stride:         port + 1 (SGLang binds only nccl_port in this mode; each rank's
                             engine needs its own).
        load_format:         "dummy" (random init; generate refuses until the first publish) or
                             a real SGLang load format such as "auto" (weights from model_path).
        version:             the version of the initial weights (stamped as the engine's
                             weight_version).
        weights_cpu_backup:  in sleep mode, keep a host copy of the weights so that ``wake()``
                             restores them (no publish needed after wake).
        context_length:      the longest prompt + max_new_tokens of a request (None: the model
                             config's ``max_position_embeddings``); requests are checked against
                             it, and SGLang gets ``context_length + CONTEXT_SLACK`` (its own
                             limits stop a few tokens short of its context).
        random_seed:         the random seed of rank 0's engine; rank r's engine uses
                             ``random_seed + r`` (distinct sampling streams); also seeds the
                             per-request seeds drawn in deterministic mode for requests without one.
        sampling_backend:    SGLang sampling kernels (None: its default, "pytorch" on the CPU;
                             deterministic mode needs None or "pytorch").
        enable_deterministic_inference: seeds honoured (``sampling_seed`` is sent; SGLang's
                             pytorch sampler and batch-invariant kernels, slower) or not (seeds
                             are not sent: SGLang would ignore them). See ``honours_seeds``.
        rl_on_policy_target: SGLang's option for logprobs that match an HF-style FSDP trainer.
        max_total_tokens:    the KV pool's size in tokens (None: SGLang sizes it from
                             ``mem_fraction_static`` on a GPU; 65536 on the CPU, where SGLang
                             would size it from host memory).
        cpu_threads:         device "cpu": the engine's threads (None: half the cores over the
                             ranks of this node, at least 1: the trainer has the other half).
        log_level:           SGLang's log level (its scheduler logs fatal tracebacks at "error").
        call_timeout_s:      limit for each call into SGLang's tokenizer manager other than
                             generation (pause, weight update, flush, memory release/resume...).
                             A call that times out leaves the engine unusable (every later call
                             raises): SGLang would hand its late reply to the next call.
        extra_server_args:   other ``ServerArgs`` fields, passed through unchecked (SGLang
                             validates them at start); may not repeat a key set above.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model_args: ModelArgs | None = None,
        device: str = "cuda",
        mem_fraction_static: float = 0.5,
        memory_mode: MemoryMode = "overlap",
        dtype: str | torch.dtype = "bfloat16",
        local_rank: int | None = None,
        base_port: int = 30000,
        port_stride: int = 8,
        load_format: str = "dummy",
        version: int = 0,
        weights_cpu_backup: bool = False,
        context_length: int | None = None,
        random_seed: int = 0,
        sampling_backend: str | None = None,
        enable_deterministic_inference: bool = False,
        rl_on_policy_target: str | None = None,
        max_total_tokens: int | None = None,
        cpu_threads: int | None = None,
        log_level: str = "error",
        call_timeout_s: float = 600.0,
        extra_server_args: Mapping[str, Any] | None = None,
    ) -> None:
        # validate everything before touching a device or starting processes
        if model_path is None:
            if model_args is None or load_format != "dummy":
                raise ValueError(
                    "engine.model_path is null: the backend writes the engine's config.json from "
                    "the trainer's model_args, which needs model_args and load_format=dummy (the "
                    "weights come from the first publish); set engine.model_path to an HF folder "
                    "otherwise"
                )
        elif not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path must be a non-empty path or null, got {model_path!r}")
        if device not in DEVICES:
            raise ValueError(f"engine.device must be one of {DEVICES}, got {device!r}")
        cpu = device == "cpu"
        if not (0.0 < float(mem_fraction_static) < 1.0):
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {mem_fraction_static!r}; e.g. 0.4 "
                "leaves 60% of the GPU to the trainer in overlap mode"
            )
        if memory_mode not in MEMORY_MODES:
            raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {memory_mode!r}")
        if cpu and memory_mode != "overlap":
            raise ValueError(
                f"engine.memory_mode={memory_mode} needs device=cuda: SGLang releases and restores "
                "its memory through torch_memory_saver (libcuda); on the CPU set "
                "engine.memory_mode=overlap (rollout.mode=alternate runs without sleeping there)"
            )
        compute = compute_dtype(dtype)
        if weights_cpu_backup and memory_mode != "sleep":
            raise ValueError("weights_cpu_backup=True only makes sense with memory_mode='sleep'")
        if context_length is not None and int(context_length) < 2:
            raise ValueError(f"context_length must be >= 2 or None, got {context_length!r}")
        if int(version) < 0:
            raise ValueError(f"version must be >= 0, got {version!r}")
        if not float(call_timeout_s) > 0:
            raise ValueError(f"engine.call_timeout_s must be > 0 seconds, got {call_timeout_s!r}")
        for key, value in (("max_total_tokens", max_total_tokens), ("cpu_threads", cpu_threads)):
            if value is not None and (isinstance(value, bool) or int(value) < 1):
                raise ValueError(f"engine.{key} must be an integer >= 1 or null, got {value!r}")
        deterministic = bool(enable_deterministic_inference)
        if deterministic:
            if sampling_backend not in (None, "pytorch"):
                raise ValueError(
                    f"engine.enable_deterministic_inference needs SGLang's pytorch sampler, but "
                    f"engine.sampling_backend is {sampling_backend!r}; remove sampling_backend "
                    "or set it to pytorch"
                )
            sampling_backend = "pytorch"
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        port, nccl_port = engine_ports(int(base_port), int(local_rank), int(port_stride))
        check_port_free(nccl_port, base_port=int(base_port), local_rank=int(local_rank))
        self._config_dir: str | None = None
        if model_path is None:
            model_path = self._config_dir = write_engine_config(model_args)
        config = read_engine_config(model_path)
        expected = expected_hf_shapes(_model_args_of(config))
        if model_args is not None:
            problems = shape_mismatches(expected, expected_hf_shapes(model_args))
            if problems:
                raise ValueError(
                    f"the trainer's model_args do not match the engine's model "
                    f"({model_path}/config.json): {'; '.join(problems)}; point engine.model_path "
                    "at the checkpoint the trainer was built from"
                )
        if context_length is None:
            context_length = int(config.get("max_position_embeddings") or 0) or None
            if context_length is None:
                raise ValueError(
                    f"{model_path}/config.json has no max_position_embeddings: set "
                    "engine.context_length (the longest prompt + max_new_tokens)"
                )
        rank = int(os.environ.get("RANK", "0"))
        kwargs = engine_server_args(
            model_path=model_path,
            local_rank=int(local_rank),
            port=port,
            nccl_port=nccl_port,
            mem_fraction_static=float(mem_fraction_static),
            dtype=str(compute).removeprefix("torch."),
            load_format=load_format,
            memory_mode=memory_mode,
            weights_cpu_backup=bool(weights_cpu_backup),
            random_seed=int(random_seed) + rank,
            version=int(version),
            context_length=int(context_length) + CONTEXT_SLACK,
            sampling_backend=sampling_backend,
            enable_deterministic_inference=deterministic,
            rl_on_policy_target=rl_on_policy_target,
            log_level=log_level,
            device=device,
            max_total_tokens=(
                CPU_MAX_TOTAL_TOKENS if cpu and max_total_tokens is None else max_total_tokens
            ),
        )
        extra = dict(extra_server_args or {})
        clash = sorted(set(extra) & set(kwargs))
        if clash:
            raise ValueError(
                f"extra_server_args repeats {clash}, which SGLangEngine sets itself; use the "
                "constructor arguments instead"
            )
        kwargs.update(extra)
        check_environment(os.environ)
        use_device(device)  # before SGLang is imported: its CPU switch is read at import
        if _running_loop() is not None:
            raise RuntimeError(
                "build SGLangEngine outside a running asyncio event loop (the engine's loop runs "
                "in a thread of its own)"
            )

        self.model_args = model_args
        self.model_path = model_path
        self.device: str = device
        self.memory_mode: str = memory_mode
        self.local_rank = int(local_rank)
        self.server_args: dict[str, Any] = kwargs
        self.honours_seeds = deterministic
        self._expected = expected
        self._context_length = int(context_length)
        self._eos_ids = _eos_ids_of(config)
        self._weights_cpu_backup = bool(weights_cpu_backup)
        self._dtype = compute
        self._device = (
            torch.device("cuda", self.local_rank) if not cpu and torch.cuda.is_available() else None
        )
        self._call_timeout_s = float(call_timeout_s)
        self._seeds = random.Random(kwargs["random_seed"])  # drawn in caller threads, locked
        self._seed_lock = threading.Lock()
        self._version = int(version)
        self._stamped = int(version)  # newest version handed to the engine
        # loop-side state (touched only by coroutines on the engine loop)
        self._memory = "awake"  # awake | asleep | weights_only
        self._has_weights = load_format != "dummy"
        self._paused = False
        self._publishing = False
        self._aborting = False
        self._inflight: dict[str, GenerateRequest] = {}
        self._waiting = 0  # requests waiting at the gate
        self._aborted: list[Completion] = []
        self._rids = itertools.count()
        self._cond: asyncio.Condition | None = None
        # caller-side serialisation of control operations
        self._control = threading.RLock()
        self._closed = False
        # what is in progress (for the death report) and whether the engine died
        self._dead: str | None = None
        self._broken: str | None = None  # a tokenizer-manager call timed out (see call_timeout_s)
        self._calls: dict[str, str] = {}  # thread name -> protocol call
        self._tm_call: str | None = None  # the tokenizer-manager call awaited on the loop
        self._engine_procs: list[Any] = []
        self._old_sigquit: Any = None
        launch_env = cpu_launch_environment(cpu_threads) if cpu else {}

        self._api = _load_sglang_api()
        main = threading.current_thread() is threading.main_thread()
        if main:
            self._old_sigquit = signal.getsignal(signal.SIGQUIT)
        register_engine(self)
        before = set(_child_processes())
        self._calls[threading.current_thread().name] = "SGLangEngine() (engine start)"
        try:
            with engine_launch_environment(extra=launch_env), logging_kept():
                self._engine = self._api.Engine(**kwargs)
        except BaseException:
            unregister_engine(self)
            if main:
                signal.signal(signal.SIGQUIT, self._old_sigquit)
            raise
        finally:
            self._calls.pop(threading.current_thread().name, None)
        self._engine_procs = [p for p in _child_processes() if p not in before]
        self._tm = self._engine.tokenizer_manager
        self._loop: asyncio.AbstractEventLoop = self._engine.loop
        if self._loop.is_running():
            self._stop_engine()
            raise RuntimeError("the SGLang engine's event loop is already running elsewhere")
        self._thread = threading.Thread(
            target=self._run_loop, name=f"sglang-engine-loop-{self.local_rank}", daemon=True
        )
        self._thread.start()
        self._call(self._init_async(), "SGLangEngine()")

    # -- loop thread ---------------------------------------------------------------------------
    def _run_loop(self) -> None:
        # CUDA calls made on this thread (the trainer's cache release before the KV cache is
        # restored) must act on this rank's GPU: a new thread's current device is GPU 0, where a
        # cudaFree would create a context (~0.5 GB) on another rank's GPU
        _bind_device(self._device)
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Any, what: str) -> Any:
        """Run ``coro`` on the engine loop and block for its result (from a plain thread).

        ``what`` names the protocol call (for the death report). Raises SGLangEngineDied as soon
        as the engine is known dead.
        """
        if _running_loop() is not None:
            coro.close()
            raise RuntimeError(
                "SGLangEngine methods block until done; call them from a thread without a running "
                "event loop (e.g. through loop.run_in_executor), never from async code"
            )
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SGLangEngine methods cannot be called from the engine loop thread")
        if self._dead is not None:
            coro.close()
            raise SGLangEngineDied(self._dead)
        if self._broken is not None:
            coro.close()
            raise RuntimeError(self._broken)
        me = threading.current_thread().name
        self._calls[me] = what
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            while not concurrent.futures.wait([future], timeout=0.1).done:
                if self._dead is not None:
                    future.cancel()
                    raise SGLangEngineDied(self._dead)
            return future.result()
        finally:
            self._calls.pop(me, None)

    async def _tm_await(self, what: str, awaitable: Any) -> Any:
        """Await one tokenizer-manager call, at most ``call_timeout_s``."""
        self._tm_call = what
        try:
            return await asyncio.wait_for(awaitable, self._call_timeout_s)
        except asyncio.TimeoutError:
            message = (
                f"rank {os.environ.get('RANK', '?')} (local_rank {self.local_rank}): SGLang "
                f"tokenizer_manager.{what} did not answer within {self._call_timeout_s:g} s "
                "(engine.call_timeout_s); the scheduler is stuck or dead: see its log in this "
                "process's stderr"
            )
            # SGLang keeps the call's reply slot armed: a late reply would be taken as the answer
            # of the next call of that kind, so no call may follow
            self._broken = f"the engine is unusable after a timed-out call: {message}"
            raise TimeoutError(message) from None
        finally:
            self._tm_call = None

    def _death_report(self) -> str:
        calls = sorted(set(self._calls.values())) or ["no call (idle)"]
        codes = ", ".join(
            f"{getattr(p, 'name', 'child')} pid {p.pid} exit code {p.exitcode}"
            for p in self._engine_procs
        )
        tm = f"; tokenizer_manager.{self._tm_call} was awaited" if self._tm_call else ""
        return (
            f"local_rank {self.local_rank} engine was in {' and '.join(calls)}{tm}; engine "
            f"processes: {codes or 'unknown'}"
        )

    def _mark_dead(self, message: str) -> None:
        self._dead = message

    async def _init_async(self) -> None:
        self._cond = asyncio.Condition()

    def _gate_open(self) -> bool:
        return not (self._paused or self._publishing)

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    # -- protocol ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The weight version that the next sampled token will carry."""
        return self._version

    @property
    def dtype(self) -> torch.dtype:
        """The engine's compute dtype (publish weights cast to it)."""
        return self._dtype

    @property
    def max_batch_size(self) -> None:
        """None: continuous batching (a finished request's place is taken at once, no waves)."""
        return None

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete every request (blocking; callable from a background thread).

        In sleep mode, the first generation after a publish restores the KV cache and CUDA
        graphs before any request is admitted (see the module docstring, "Memory modes")."""
        requests = list(requests)
        validate_requests(requests, max_seq_len=self._context_length)
        self._check_open()
        if not requests:
            return []
        params = [self._sampling_params(r.params) for r in requests]
        return self._call(self._generate_async(requests, params), "generate")

    def stream(
        self, requests: Sequence[GenerateRequest], *, until_groups: int | None = None
    ) -> Iterator[Completion]:
        """Yield completions as they finish; with ``until_groups=k``, once ``k`` groups have
        every request finished, abort the call's other requests in SGLang and yield their
        partial completions last, in request order (the protocol's "Streaming groups"; a few
        more tokens may come before an abort lands, each with its exact version).

        The requests are validated and admitted when this is called (so errors come here);
        the iterator delivers completions to the calling thread as they end. Closing it early
        (``close()``, or dropping it after a ``break``) aborts what is left of the call and waits
        until those requests have ended (while the engine is paused, at most a moment: requests
        ``pause()`` retracted answer their abort at once). An engine-wide ``abort()`` ends the
        stream with the partial completions."""
        requests = list(requests)
        validate_requests(requests, max_seq_len=self._context_length)
        call = _StreamCall(requests, GroupCounter(requests, until_groups))
        self._check_open()
        if not requests:
            return iter(())
        params = [self._sampling_params(r.params) for r in requests]
        self._call(self._stream_start(call, params), "stream")
        results = self._stream_results(call)
        next(results)  # enter its try block now, so that closing or dropping it aborts the call
        return results

    def _stream_results(self, call: _StreamCall) -> Iterator[Any]:
        """The caller's side of one stream: its first ``yield`` (None) only primes it."""
        ended = False
        try:
            yield None
            while True:
                kind, value = self._stream_next(call)
                if kind == "end":
                    ended = True
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            if not ended and self._dead is None and not self._closed:
                self._call(self._stream_close(call), "stream (closing it)")

    def _stream_next(self, call: _StreamCall) -> tuple[str, Any]:
        """The next message of ``call`` (blocking); raises once the engine is dead or shut down."""
        me = threading.current_thread().name
        self._calls[me] = "stream"
        try:
            while True:
                try:
                    return call.out.get(timeout=0.1)
                except queue.Empty:
                    if self._dead is not None:
                        raise SGLangEngineDied(self._dead) from None
                    if self._closed and not self._thread.is_alive():
                        if not call.out.empty():
                            continue
                        raise RuntimeError(
                            "the SGLangEngine was shut down during stream()"
                        ) from None
        finally:
            self._calls.pop(me, None)

    def publish_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load new weights bucket by bucket (HF names, full tensors), then stamp ``version``.

        Iterates ``buckets`` in the calling thread (FSDP gathers are collectives: every rank must
        call this with the same parameter order). Every name and shape is checked against the
        engine's model before the bucket is sent, and the whole set must be covered. If the
        publish fails while generation is paused, the paused requests are aborted (they would
        otherwise resume on half-loaded weights). See the module docstring for the sequence.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}")
        with self._control:
            self._check_open()
            if version < self._version:
                raise ValueError(
                    f"version must not decrease: got {version}, the engine has {self._version}"
                )
            what = f"publish_weights(version={version})"
            self._call(self._begin_publish(), what)
            seen: set[str] = set()
            try:
                for i, bucket in enumerate(buckets):
                    named = self._prepare_bucket(bucket, i, seen)
                    payload = serialize_bucket(self._api, named, cuda=self.device == "cuda")
                    self._call(self._push_bucket(payload, i), f"{what}, bucket {i}")
                    # the engine has loaded the bucket: drop every reference, free the IPC handles
                    del bucket, named, payload
                    _cuda_ipc_collect()
                _cuda_ipc_collect()
                missing = [n for n in self._expected if n not in seen]
                if missing:
                    raise ValueError(
                        f"publish_weights(version={version}) did not publish "
                        f"{len(missing)} of the engine's weights ({', '.join(missing[:8])}"
                        f"{', ...' if len(missing) > 8 else ''}): the engine would keep its old "
                        "or dummy values; publish every parameter (full_tensor_buckets does)"
                    )
                self._call(self._finish_publish(version), what)
            except BaseException:
                if self._dead is None:
                    self._call(self._fail_publish(), f"{what} (failed: ending it)")
                raise

    def pause(self) -> None:
        """Stop sampling; in-flight requests are retracted (their tokens kept, KV recomputed)."""
        with self._control:
            self._check_open()
            self._call(self._pause_async(), "pause")

    def resume(self) -> None:
        """Continue the paused requests with whatever weights are loaded now."""
        with self._control:
            self._check_open()
            self._call(self._resume_async(), "resume")

    def abort(self) -> list[Completion]:
        """Stop every in-flight request; return their partial completions.

        Requests that ``pause()`` retracted return the tokens SGLang had already sent to this
        process (see docs/sglang_backend.md, known limits); running requests return all theirs.
        """
        with self._control:
            self._check_open()
            return self._call(self._abort_async(), "abort")

    def sleep(self) -> None:
        """sleep mode: release weights, KV cache and CUDA graphs (engine idle; only the weights
        when no generation restored the KV cache since wake()). overlap: no-op."""
        if self.memory_mode != "sleep":
            return
        with self._control:
            self._check_open()
            self._call(self._sleep_async(), "sleep")

    def wake(self) -> None:
        """sleep mode: restore the weights' memory (values undefined unless weights_cpu_backup:
        then everything is restored); after the next publish_weights, the first generate /
        stream restores KV cache + CUDA graphs. overlap: no-op. The trainer's cached CUDA blocks
        are returned to the driver first."""
        if self.memory_mode != "sleep":
            return
        with self._control:
            self._check_open()
            _cuda_release_cache()
            self._call(self._wake_async(), "wake")

    def shutdown(self) -> None:
        """Abort what is in flight, stop the loop thread and the engine's processes. Idempotent.

        Only the engine's own processes end (SGLang's ``Engine.shutdown`` alone would kill every
        child process of this process: see :meth:`_stop_engine`). The SIGQUIT handler that was in
        place before the engine was built is restored.
        """
        with self._control:
            if self._closed:
                return
            self._closed = True
            try:
                if self._thread.is_alive() and self._dead is None and self._broken is None:
                    self._call(self._shutdown_async(), "shutdown")
            finally:
                if self._thread.is_alive():
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    self._thread.join(timeout=30.0)
                try:
                    self._stop_engine()
                finally:
                    unregister_engine(self)
                    if self._config_dir is not None:
                        shutil.rmtree(self._config_dir, ignore_errors=True)
                    if self._old_sigquit is not None and (
                        threading.current_thread() is threading.main_thread()
                    ):
                        signal.signal(signal.SIGQUIT, self._old_sigquit)

    def _stop_engine(self) -> None:
        """``Engine.shutdown()``, with its process kill narrowed to the engine's own processes.

        SGLang 0.5.23's shutdown (also registered to run at interpreter exit: that registration is
        removed) ends with ``kill_process_tree(os.getpid(), include_parent=False)``:
        a SIGKILL of every child process of this process, not only its scheduler and detokenizer:
        data-loader workers, multiprocessing's resource tracker (whose death makes Python print a
        traceback at exit), a TorchEngine. For that one call the module's ``kill_process_tree``
        kills each process the engine started (and what they started) instead, with SGLang's own
        function, and waits until they are reaped."""
        # SGLang registers the same shutdown at interpreter exit, where it would kill everything
        atexit.unregister(self._engine.shutdown)
        module = sys.modules.get(type(self._engine).__module__)
        everything = getattr(self._api, "kill_process_tree", None)
        if everything is None or getattr(module, "kill_process_tree", None) is not everything:
            self._engine.shutdown()  # an engine that kills nothing of ours (tests' stand-ins)
            return

        def engine_only(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
            if parent_pid != os.getpid() or include_parent:  # not the blanket kill: as it was
                return everything(parent_pid, include_parent, skip_pid, wait_timeout)
            for proc in self._engine_procs:
                if proc.is_alive():
                    self._api.kill_process_tree(
                        parent_pid=proc.pid, include_parent=True, wait_timeout=wait_timeout
                    )
            return None

        module.kill_process_tree = engine_only
        try:
            self._engine.shutdown()
        finally:
            module.kill_process_tree = everything

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- checks (caller thread) ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._dead is not None:
            raise SGLangEngineDied(self._dead)
        if self._closed:
            raise RuntimeError("the SGLangEngine is shut down")

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        """SGLang's dict; in deterministic mode an unseeded sampled request gets a drawn seed."""
        if self.honours_seeds and params.seed is None and params.temperature > 0:
            with self._seed_lock:
                seed = self._seeds.getrandbits(62)
            params = dataclasses.replace(params, seed=seed)
        return sglang_sampling_params(params, send_seed=self.honours_seeds)

    def _check_can_generate(self) -> None:
        # "weights_only" with valid weights (published after wake()) is fine: the first request
        # restores the KV cache and CUDA graphs (_restore_kv)
        if self._memory == "asleep":
            raise RuntimeError(
                "generate() while the engine is asleep: in sleep mode call wake() and then "
                "publish_weights(...) before generating"
            )
        if not self._has_weights:
            raise RuntimeError(
                "the engine has no valid weights (load_format='dummy', wake() without a CPU "
                "backup, or a failed publish): call publish_weights(...) first"
            )

    def _prepare_bucket(
        self, bucket: WeightBucket, index: int, seen: set[str]
    ) -> list[tuple[str, torch.Tensor]]:
        return prepare_bucket(
            bucket,
            index,
            expected=self._expected,
            seen=seen,
            device=self._device,
            dtype=self._dtype,
            model_path=self.model_path,
        )

    # -- coroutines (engine loop) --------------------------------------------------------------
    async def _generate_async(
        self, requests: list[GenerateRequest], params: list[dict[str, Any]]
    ) -> list[Completion]:
        if self._gate_open():
            self._check_can_generate()  # fail fast, before any request is admitted
        tasks = [asyncio.ensure_future(self._generate_one(r, p)) for r, p in zip(requests, params)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a cancelled request is aborted inside SGLang
                task.cancel()
            raise

    async def _generate_one(
        self,
        req: GenerateRequest,
        params: dict[str, Any],
        call: _StreamCall | None = None,
        index: int = -1,
    ) -> Completion:
        """One request, from the gate to its completion; ``call`` / ``index``: the stream call it
        belongs to (a request of a stopping stream that has not been admitted ends empty)."""
        assert self._cond is not None

        def stopped() -> bool:
            return self._aborting or (call is not None and call.stopping)

        async with self._cond:
            self._waiting += 1
            try:
                while True:
                    await self._cond.wait_for(lambda: stopped() or self._gate_open())
                    if stopped():
                        break
                    self._check_can_generate()
                    if self._memory == "awake":
                        break
                    # the lock is held: the other requests wait until the KV cache is back,
                    # and then check the gate again (it may have closed meanwhile)
                    await self._restore_kv()
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            if stopped():
                done = _empty_abort(req)
                if self._aborting:
                    self._aborted.append(done)
                return done
            rid = engine_rid(next(self._rids), req.request_id)
            low = self._version
            self._inflight[rid] = req
            if call is not None:
                call.rids[index] = rid
        try:
            out = await self._engine.async_generate(
                input_ids=list(req.prompt_ids),
                sampling_params=params,
                return_logprob=True,
                rid=rid,
            )
        finally:
            async with self._cond:
                del self._inflight[rid]
                self._cond.notify_all()
        done = completion_from_output(req, out, low=low, high=self._stamped, eos_ids=self._eos_ids)
        if self._aborting:
            self._aborted.append(done)
        return done

    async def _restore_kv(self) -> None:
        """Sleep mode, first request after a publish: give the trainer's cached CUDA blocks back
        to the driver (torch_memory_saver maps the engine's memory back with cuMemCreate, which
        fails while this process's allocator keeps them), then restore KV cache and CUDA graphs.
        Runs on the loop with the gate's lock held and nothing in flight."""
        _cuda_release_cache()
        await self._tm_await(
            "resume_memory_occupation(kv_cache, cuda_graph)",
            self._tm.resume_memory_occupation(
                obj=self._api.ResumeMemoryOccupationReqInput(tags=[_MEM_KV, _MEM_GRAPH]),
                request=None,
            ),
        )
        self._memory = "awake"

    async def _stream_start(self, call: _StreamCall, params: list[dict[str, Any]]) -> None:
        if self._gate_open():
            self._check_can_generate()  # fail fast, before any request is admitted
        call.left = len(call.requests)
        for i, (req, p) in enumerate(zip(call.requests, params)):
            task = asyncio.ensure_future(self._generate_one(req, p, call, i))
            task.add_done_callback(functools.partial(self._stream_part, call, i))
            call.tasks.append(task)

    def _stream_part(self, call: _StreamCall, index: int, task: asyncio.Task) -> None:
        """A request of ``call`` ended (a done callback, on the loop): hand its completion to the
        caller, or hold it (after the stop); stop the others once enough groups are complete."""
        if call.closed or self._stream_failed(call, task):
            return
        done = task.result()
        call.left -= 1
        if call.stopping:
            call.held[index] = done
        else:
            call.out.put(("part", done))
            if done.finish_reason != "abort" and call.counter.finish(index):
                call.stopping = True
                call.stopper = asyncio.ensure_future(self._stop_stream(call))
                call.stopper.add_done_callback(functools.partial(self._stream_failed, call))
        if call.left == 0:
            for i in sorted(call.held):
                call.out.put(("part", call.held[i]))
            call.out.put(("end", None))

    @staticmethod
    def _stream_failed(call: _StreamCall, task: asyncio.Task) -> bool:
        """If ``task`` (of ``call``) failed: hand the error to the caller, who raises it and then
        closes the call; True then."""
        if not task.cancelled() and task.exception() is None:
            return False
        if not call.closed:
            call.closed = True
            error = None if task.cancelled() else task.exception()
            call.out.put(("error", error or RuntimeError("stream(): a request was cancelled")))
        return True

    async def _stop_stream(self, call: _StreamCall) -> None:
        """Stop the call's requests: those waiting at the gate end empty (woken here, they see
        ``call.stopping``); each one in SGLang is aborted by its rid, once."""
        await self._notify()
        for rid in call.rids.values():
            if rid in self._inflight and rid not in call.aborted:
                call.aborted.add(rid)
                self._tm.abort_request(rid=rid)

    async def _stream_close(self, call: _StreamCall, paused_wait_s: float = 0.5) -> None:
        """The caller closed the stream before its end: drop what comes, stop the rest, wait
        until it has ended. While paused only ``paused_wait_s``: the retracted requests answer
        their abort at once, a request still held in the tokenizer manager only after resume()."""
        call.closed = True
        call.stopping = True
        await self._stop_stream(call)
        pending = [t for t in call.tasks if not t.done()]
        if not pending:
            return
        _, pending_set = await asyncio.wait(
            pending, timeout=paused_wait_s if self._paused else self._call_timeout_s
        )
        if pending_set and not self._paused:
            raise TimeoutError(
                f"stream(): {len(pending_set)} aborted requests did not end within "
                f"{self._call_timeout_s:g} s (engine.call_timeout_s); the SGLang scheduler is "
                "not answering"
            )

    async def _drain(self) -> None:
        """Wait until no request is in flight (the gate must already be closed)."""
        assert self._cond is not None
        async with self._cond:
            await self._cond.wait_for(lambda: not self._inflight)

    async def _flush(self, why: str) -> None:
        """``flush_cache``, retried while the scheduler is not yet fully idle (its overlap loop
        keeps the last batch for about one iteration after the last output)."""
        for attempt in range(FLUSH_ATTEMPTS):
            flushed = await self._tm_await("flush_cache", self._tm.flush_cache())
            if flushed.success:
                return
            if attempt + 1 < FLUSH_ATTEMPTS:
                await asyncio.sleep(FLUSH_RETRY_S)
        raise RuntimeError(
            f"SGLang flush_cache {why} failed {FLUSH_ATTEMPTS} times {FLUSH_RETRY_S:g} s apart "
            f"(the engine is not idle): {flushed}"
        )

    def _continue_req(self) -> Any:
        # the trainer shares the GPU: the engine keeps its cached blocks instead of returning
        # them to the driver (where a trainer allocation could take them and the engine's next
        # large allocation would fail, which is fatal)
        return self._api.ContinueGenerationReqInput(torch_empty_cache=False)

    async def _begin_publish(self) -> None:
        if self._memory == "asleep":
            raise RuntimeError(
                "publish_weights() while the engine sleeps: call wake() first (sleep mode "
                "sequence: wake -> publish_weights -> generate / stream ... -> sleep)"
            )
        self._publishing = True  # no new request starts until the last bucket is in
        try:
            if not self._paused:
                await self._drain()
            ok, message = await self._tm_await(
                "begin_weight_update",
                self._tm.begin_weight_update(
                    obj=self._api.BeginWeightUpdateReqInput(), request=None
                ),
            )
            if not ok:
                raise RuntimeError(f"SGLang begin_weight_update failed: {message}")
        except BaseException:
            self._publishing = False
            await self._notify()
            raise
        self._has_weights = False  # until the whole set is in

    async def _push_bucket(self, payload: Any, index: int) -> None:
        ok, message = await self._tm_await(
            f"update_weights_from_tensor (bucket {index})",
            self._tm.update_weights_from_tensor(
                obj=self._api.UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[payload],  # one payload per TP rank; tp_size == 1
                    load_format=None,
                    flush_cache=False,
                ),
                request=None,
            ),
        )
        if not ok:
            raise RuntimeError(
                f"SGLang update_weights_from_tensor failed on bucket {index}: {message}"
            )

    async def _finish_publish(self, version: int) -> None:
        ok, message = await self._tm_await(
            "end_weight_update",
            self._tm.end_weight_update(obj=self._api.EndWeightUpdateReqInput(), request=None),
        )
        if not ok:
            raise RuntimeError(f"SGLang end_weight_update failed: {message}")
        await self._flush("after the weight update")
        self._stamped = max(self._stamped, version)
        await self._tm_await(
            "update_weight_version",
            self._tm.update_weight_version(
                obj=self._api.UpdateWeightVersionReqInput(
                    new_version=str(version), abort_all_requests=False
                )
            ),
        )
        # sleep mode: the KV cache and CUDA graphs stay released until the first request
        # (_restore_kv), so the trainer can offload in between
        self._version = version
        self._has_weights = True
        self._publishing = False
        await self._notify()

    async def _fail_publish(self) -> None:
        # the weights may be half-updated: refuse to generate until a publish succeeds, and
        # abort the requests pause() retracted instead of letting resume() continue them
        self._has_weights = False
        try:
            await self._tm_await(
                "end_weight_update",
                self._tm.end_weight_update(obj=self._api.EndWeightUpdateReqInput(), request=None),
            )
            if self._paused and self._inflight:
                await self._abort_async()
        finally:
            self._publishing = False
            await self._notify()

    async def _pause_async(self) -> None:
        if self._paused:
            return
        self._paused = True
        await self._tm_await(
            "pause_generation",
            self._tm.pause_generation(obj=self._api.PauseGenerationReqInput(mode="retract")),
        )

    async def _resume_async(self) -> None:
        if not self._paused:
            return
        await self._tm_await(
            "continue_generation", self._tm.continue_generation(obj=self._continue_req())
        )
        self._paused = False
        await self._notify()

    async def _abort_async(
        self, resend_s: float = 0.5, timeout_s: float = 300.0
    ) -> list[Completion]:
        """Abort everything in flight. While paused, the retracted requests are aborted where
        they wait (no further step runs); only if some are still in flight after ``resend_s``
        (held in the tokenizer manager, never sent to the scheduler) is the scheduler let run
        (continue) so that the abort reaches them, and paused again."""
        assert self._cond is not None
        self._aborting = True
        self._aborted = []
        await self._notify()  # requests waiting at the gate finish as empty aborts
        start = time.monotonic()
        if self._paused:
            self._tm.abort_request(abort_all=True)
            while self._inflight and time.monotonic() - start < resend_s:
                await asyncio.sleep(0.005)
        continued = self._paused and bool(self._inflight)
        if continued:
            # a request admitted just before pause() may still wait in the tokenizer manager
            # (never sent to the scheduler, so abort_all would miss it): let it through
            await self._tm_await(
                "continue_generation", self._tm.continue_generation(obj=self._continue_req())
            )
        last = None
        while self._inflight:
            now = time.monotonic()
            if now - start > timeout_s:
                raise RuntimeError(
                    f"abort(): {len(self._inflight)} requests still in flight after {timeout_s} s; "
                    "the SGLang scheduler is not answering"
                )
            if last is None or now - last > resend_s:
                self._tm.abort_request(abort_all=True)
                last = now
            await asyncio.sleep(0.005)
        if continued:
            await self._tm_await(
                "pause_generation",
                self._tm.pause_generation(obj=self._api.PauseGenerationReqInput(mode="retract")),
            )
        async with self._cond:  # the woken gate waiters record their empty completions
            await self._cond.wait_for(lambda: self._waiting == 0)
        self._aborting = False
        await self._notify()
        done, self._aborted = self._aborted, []
        return done

    async def _sleep_async(self) -> None:
        assert self._cond is not None
        async with self._cond:  # no request is admitted (nor the KV cache restored) meanwhile
            if self._memory == "asleep":
                return
            if self._inflight:
                raise RuntimeError(
                    f"sleep() needs an idle engine, {len(self._inflight)} requests are in "
                    "flight; wait for them or abort() first"
                )
            # release asserts that the scheduler is fully idle (fatal otherwise); a successful
            # flush proves it. After wake() (and a publish) without generating, only the weights
            # hold memory (no KV to flush).
            if self._memory == "awake":
                await self._flush("before releasing the engine's memory")
            tags = [_MEM_WEIGHTS] if self._memory == "weights_only" else None  # None = all
            await self._tm_await(
                f"release_memory_occupation({tags or 'all'})",
                self._tm.release_memory_occupation(
                    obj=self._api.ReleaseMemoryOccupationReqInput(tags=tags), request=None
                ),
            )
            self._memory = "asleep"

    async def _wake_async(self) -> None:
        if self._memory != "asleep":
            return
        if self._weights_cpu_backup:
            await self._tm_await(
                "resume_memory_occupation(all)",
                self._tm.resume_memory_occupation(
                    obj=self._api.ResumeMemoryOccupationReqInput(tags=None), request=None
                ),
            )
            self._memory = "awake"
        else:
            await self._tm_await(
                "resume_memory_occupation(weights)",
                self._tm.resume_memory_occupation(
                    obj=self._api.ResumeMemoryOccupationReqInput(tags=[_MEM_WEIGHTS]),
                    request=None,
                ),
            )
            self._memory = "weights_only"
            self._has_weights = False  # undefined contents until the next publish

    async def _shutdown_async(self) -> None:
        if self._inflight or self._paused:
            await self._abort_async()
        me = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not me:
                task.cancel()


def read_engine_config(model_path: str) -> dict[str, Any]:
    """``model_path``/config.json (ValueError naming the file when it cannot be read)."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(
            f"engine.model_path must be a local HF folder with config.json (the published "
            f"weights are checked against it): cannot read {path}: {e.strerror}"
        ) from None


def write_engine_config(model_args: ModelArgs) -> str:
    """A new temporary folder holding the HF config.json of ``model_args`` (for an engine started
    with ``load_format="dummy"``, whose weights come from the first publish); its path."""
    import tempfile

    from minippo.models.hf_checkpoint import hf_config_from_model_args

    folder = tempfile.mkdtemp(prefix="minippo-sglang-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config_from_model_args(model_args), f, indent=1)
    return folder


def _model_args_of(config: Mapping[str, Any]) -> ModelArgs:
    from minippo.models import model_args_from_hf_config

    return model_args_from_hf_config(dict(config))


def _eos_ids_of(config: Mapping[str, Any]) -> frozenset[int]:
    """The model's EOS ids from its config.json (SGLang stops at them unless ``ignore_eos``)."""
    eos = config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _child_processes() -> list[Any]:
    return multiprocessing.active_children()
