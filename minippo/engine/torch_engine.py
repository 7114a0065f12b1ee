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

Sampling (per row; each request owns a ``torch.Generator`` seeded by its ``seed``):
    z = logits / T  (T = 1 for greedy),   logprob(token) = log_softmax(z)[token] over the full vocab
    top-k / top-p remove tokens from z (never renormalising the reported logprob);
    token = first index i with cdf_i > u · cdf_V,  cdf = running sum of exp(z_kept - max z) in
            float64, u ~ U(0, 1): one uniform per row and step (inverse-CDF sampling, searched
            block by block: see ``sample_next``)
    greedy (T == 0): token = argmax(logits).
Each row's random draws depend only on its own generator, so a seeded request gives the same tokens
whatever else is in the batch (up to floating-point differences of batched matmuls).

Kernels: on CPU (float32 / bfloat16, oneDNN) every linear layer of the engine's model copy runs
with weights packed once per publish (``pack_linears``); see docs/engine.md.

Process model: ``TorchEngine(model)`` sends ``(ModelArgs, state dict)`` to a spawned child process
that builds its own copy of the model and serves requests from a message queue, so generation
really overlaps training in the parent. ``in_process=True`` runs the same serving loop in a thread of
the calling process on a private copy of the model (for tests and debugging). The parent-side API
is thread-safe.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import queue as queue_lib
import random
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from minippo.engine.protocol import Completion, GenerateRequest, WeightBucket, validate_requests
from minippo.models import KVCache, Transformer, native_name


def default_num_threads() -> int:
    """Torch threads of the engine process: half the cores (1 on a 2-core machine)."""
    return max(1, (os.cpu_count() or 2) // 2)


# ----------------------------------------------------------------------------------------------
# Sampling (pure functions)


_CDF_BLOCK = 256  # vocabulary block of the two-level inverse-CDF search in ``sample_next``


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tokens Long[k], logprobs Float32[k])``.

    logits Float[k, V]; temperature Float[k] (0 = greedy); top_k Long[k] (0 = off);
    top_p Float[k] (1 = off); generators: one per row.

    z = logits / T (T = 1 for greedy rows);  logprob = z[token] - logsumexp(z)  (full vocabulary)
    sampling: inverse CDF of softmax(z restricted to top-k / top-p), one uniform u per row from
    the row's own generator: token = first i with cdf_i > u * cdf_V, with cdf the running sum of
    exp(z - max z) in float64. The search runs in two levels so that no [k, V] cumulative sum is
    built: block sums (blocks of ``_CDF_BLOCK`` tokens) locate the block, one cumulative sum inside
    that block locates the token.
    """
    k = logits.shape[0]
    z = logits.float()
    greedy = temperature <= 0
    if bool((temperature != 1).any()):
        z = z / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    zmax = z.amax(dim=-1, keepdim=True)
    e = (z - zmax).exp_()  # softmax numerators, [k, V], max entry 1
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    filtered = bool(((top_k > 0) | (top_p < 1))[~greedy].any()) if sampled_rows else False
    block_mass = _block_sums(e)  # [k, n_blocks] float64
    # logsumexp(z) = zmax + log Σ exp(z - zmax)
    lse = zmax.squeeze(-1).double() + block_mass.sum(-1).log()
    if len(sampled_rows) < k:
        tokens = z.argmax(dim=-1)
    else:
        tokens = torch.empty(k, dtype=torch.long, device=logits.device)
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        all_rows = len(sampled_rows) == k
        probs, mass = (e, block_mass) if all_rows else (e[rows], block_mass[rows])
        if filtered:
            probs = _filter_top_k_top_p(probs, top_k[rows], top_p[rows])
            mass = _block_sums(probs)
        u = torch.cat(
            [torch.rand(1, generator=generators[r], device=e.device) for r in sampled_rows]
        )
        tokens[rows] = _inverse_cdf(probs, mass, u)
    logprobs = (z.gather(-1, tokens[:, None]).squeeze(-1).double() - lse).float()
    return tokens, logprobs


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Float64 sums of consecutive ``_CDF_BLOCK``-token blocks of ``probs [k, V]`` (the last
    block may be shorter): ``[k, ceil(V / _CDF_BLOCK)]``."""
    k, vocab = probs.shape
    full = vocab // _CDF_BLOCK * _CDF_BLOCK
    parts = []
    if full:
        parts.append(probs[:, :full].reshape(k, -1, _CDF_BLOCK).sum(-1, dtype=torch.float64))
    if full < vocab:
        parts.append(probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _inverse_cdf(probs: torch.Tensor, block_mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index i with cdf_i > u * cdf_V per row (``probs [k, V] >= 0``, unnormalised;
    ``block_mass = _block_sums(probs)``; ``u [k]`` in [0, 1)). The drawn token always has
    positive mass, whatever the rounding of the two summation orders."""
    k, vocab = probs.shape
    block_cdf = block_mass.cumsum(dim=-1)
    target = u.double() * block_cdf[:, -1]
    n_blocks = block_cdf.shape[1]
    b = torch.searchsorted(block_cdf, target[:, None], right=True).clamp_(max=n_blocks - 1)
    before = block_cdf.gather(1, b).squeeze(-1) - block_mass.gather(1, b).squeeze(-1)
    # the tokens of each row's block (a short last block is padded with zero mass)
    idx = b * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)[None, :]
    inside = idx < vocab
    seg = probs.gather(1, idx.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    seg_cdf = seg.double().cumsum_(dim=-1)
    rest = (target - before).clamp_(min=0.0)[:, None]  # >= 0: the first pick has positive mass
    j = torch.searchsorted(seg_cdf, rest, right=True).squeeze(-1)
    # rounding can put the target past the block's last positive token: take that token then
    positive = torch.arange(_CDF_BLOCK, device=probs.device)[None, :].expand(k, -1)
    last_positive = positive.masked_fill(seg <= 0, -1).amax(dim=-1)
    j = torch.minimum(j, last_positive)
    return b.squeeze(-1) * _CDF_BLOCK + j


def _filter_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Zero the (unnormalised) probabilities outside each row's top-k and top-p nucleus.

    probs Float[k, V] >= 0. top-k keeps ranks < k (k = 0: all); top-p keeps a token when the
    normalised mass of the tokens ranked before it is < p (the most likely token is always kept).
    Rows with neither filter come back unchanged.

    Only the head of each row is ranked: ``topk(n)`` with n = 64, 1024, 16384, ... until every
    filtered row's cut falls inside its first n tokens, because sorting all V entries costs far
    more than a decode step; once n would pass V / 8 the rows are sorted instead.
    """
    vocab = probs.shape[-1]
    filtered = (top_k > 0) | (top_p < 1)
    total = probs.sum(-1, keepdim=True, dtype=torch.float64)
    n = min(vocab, max(64, int(top_k.max())))
    while True:
        if n >= vocab:
            vals, order = probs.sort(dim=-1, descending=True)
        else:
            vals, order = probs.topk(n, dim=-1)  # sorted, descending
        rank = torch.arange(vals.shape[-1], device=probs.device)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        mass_before = (vals.double().cumsum(dim=-1) - vals.double()) / total
        keep &= (top_p[:, None] >= 1) | (mass_before < top_p[:, None].double())  # 1: off
        if n >= vocab or not bool((keep[:, -1] & filtered).any()):
            break
        n = 16 * n if 16 * n <= vocab // 8 else vocab
    out = torch.zeros_like(probs).scatter_(-1, order, vals.masked_fill(~keep, 0.0))
    return torch.where(filtered[:, None], out, probs)


def _onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear kernel can run on ``device`` in ``dtype``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class _PackedLinear(nn.Module):
    """An ``nn.Linear``'s own parameters, applied with oneDNN's packed CPU kernel.

    The weight is reordered once into oneDNN's blocked layout (``repack()``, after every weight
    change) instead of on every call: for the decode shapes (a few dozen rows) this runs the
    matmuls up to about twice as fast as ``F.linear`` (same math; docs/benchmarks.md). The
    parameters stay the module's ``weight`` / ``bias``, so names and publishes are unchanged.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.repack()

    def repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> list[_PackedLinear]:
    """Replace every ``nn.Linear`` of ``model`` (the engine's private copy) by a
    :class:`_PackedLinear` sharing its parameters; return them (call ``repack()`` after loading
    new weights). Needs :func:`_onednn_linear_available` for the model's device and dtype."""
    packed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = _PackedLinear(child)
                setattr(parent, name, new)
                packed.append(new)
    return packed


# ----------------------------------------------------------------------------------------------
# The serving loop (runs in the child process, or in a thread with in_process=True)


@dataclass
class _Row:
    """One request being generated."""

    request: GenerateRequest
    call_id: int
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def completion(self) -> Completion:
        return Completion(
            request_id=self.request.request_id,
            prompt_ids=list(self.request.prompt_ids),
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason or "abort",  # type: ignore[arg-type]
        )


class _Abort(Exception):
    """Raised inside a wave when abort() arrives."""


class _Server:
    """Owns the model copy; serves messages ``(kind, call_id, payload)`` from ``inbox``.

    Replies ``("ok", call_id, result)`` or ``("error", call_id, message)`` go to ``outbox``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        version: int,
        seed: int,
        max_batch_size: int,
        compact: bool,
        inbox: Any,
        outbox: Any,
    ) -> None:
        self.model = model.eval()
        self.version = version
        self.max_batch_size = max_batch_size
        self.compact = compact
        self.inbox, self.outbox = inbox, outbox
        self.seed_rng = random.Random(seed)
        # every name, tied ones included (a tied lm_head, if sent, lands in the embedding)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # CPU float32 / bfloat16 with oneDNN: every linear layer (lm_head included) runs with
        # weights packed once per publish; elsewhere the model's own nn.Linear layers
        packable = _onednn_linear_available(self.device, self.dtype)
        self.linear_kernel = "onednn_packed" if packable else "torch"
        self.packed = pack_linears(self.model) if packable else []
        self.waiting: list[_Row] = []
        self.active: list[_Row] = []  # rows of the running wave
        self.calls: dict[int, list[_Row]] = {}  # generate call -> its rows in request order
        self.paused = False
        self.stale_cache = False
        self.running = True
        self.stats = {"waves": 0, "decode_steps": 0, "row_steps": 0, "reprefills": 0}

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
            if kind == "generate":
                rows = []
                for req in payload:
                    seed = req.params.seed
                    if seed is None:
                        seed = self.seed_rng.randrange(1 << 62)
                    gen = torch.Generator(device=self.device).manual_seed(seed)
                    rows.append(_Row(req, call_id, gen))
                self.calls[call_id] = rows
                self.waiting.extend(rows)
                return  # replied when all rows finish
            if kind == "pause":
                self.paused = True
            elif kind == "resume":
                self.paused = False
            elif kind == "publish_begin":
                self._publish(call_id, payload)
            elif kind == "abort":
                self._reply(call_id, self._abort_all())
                return
            elif kind == "progress":
                result = {
                    r.request.request_id: len(r.token_ids)
                    for r in self.active
                    if r.finish_reason is None
                }
                result.update({r.request.request_id: 0 for r in self.waiting})
                self._reply(call_id, result)
                return
            elif kind == "stats":
                self._reply(call_id, {**self.stats, "linear_kernel": self.linear_kernel})
                return
            elif kind in ("sleep", "wake"):
                self._sleep_wake(kind)
            elif kind == "shutdown":
                self._abort_all()
                self.running = False
            else:
                raise ValueError(f"unknown engine message {kind!r}")
            self._reply(call_id, None)
        except Exception:
            self.outbox.put(("error", call_id, traceback.format_exc()))

    def _publish(self, call_id: int, version: int) -> None:
        """Apply buckets until ``publish_end``; other messages meanwhile are handled normally.

        A bad name or shape fails the publish (after reading the rest of it) and leaves the
        weights partly updated and the version unchanged: publish again.
        """
        error: Exception | None = None
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
        if error is not None:
            raise error
        for layer in self.packed:
            layer.repack()
        self.version = version
        self.stale_cache = True  # in-flight rows re-prefill under the new weights

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

    def _sleep_wake(self, kind: str) -> None:
        if self.active or self.waiting:
            raise RuntimeError(f"{kind}() needs an idle engine; abort or wait for requests first")
        if self.device.type == "cuda":
            if kind == "sleep":
                self.model.to("cpu")
                torch.cuda.empty_cache()
            else:
                self.model.to(self.device)
            self.params = dict(self.model.named_parameters(remove_duplicate=False))

    def _finish_calls(self) -> None:
        for call_id in [c for c, rows in self.calls.items() if all(r.finish_reason for r in rows)]:
            self._reply(call_id, [r.completion() for r in self.calls.pop(call_id)])

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

        col = p_len  # column of the next sampled tokens
        no_padding = bool(mask.all())
        # pos: position id of the newest token of each row, Long[k, 1]
        logits, cache, pos = self._prefill(seq[:, :col], mask[:, :col], p_len + max_new, no_padding)
        self.stale_cache = False
        while True:
            tokens, logprobs = sample_next(
                logits, temperature, top_k, top_p, [r.generator for r in rows]
            )
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
            h = self.model(
                tokens[:, None],
                position_ids=pos,
                attention_mask=None if no_padding else mask[:, :col],  # cached + new keys
                kv_cache=cache,
                return_hidden=True,
            )
            logits = self.model.output(h[:, -1])


def _serve_in_child(spec: dict, inbox: Any, outbox: Any) -> None:
    """Entry point of the engine process: build the model copy, then serve until shutdown."""
    torch.set_num_threads(spec["num_threads"])
    model = _build_model(spec)
    outbox.put(("ok", 0, "ready"))
    server = _Server(model, inbox=inbox, outbox=outbox, **spec["server"])
    server.serve()


def _build_model(spec: dict) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(spec["args"])
    model = model.to_empty(device=spec["device"])
    missing, unexpected = model.load_state_dict(spec["state_dict"], strict=False)
    missing = [
        m for m in missing if not (m == "output.weight" and spec["args"].tie_word_embeddings)
    ]
    if missing or unexpected:
        raise ValueError(f"engine model state dict mismatch: {missing=} {unexpected=}")
    model.tie_weights()  # no-op unless tie_word_embeddings (Transformer._apply re-ties too)
    return model.to(spec["dtype"]).eval()


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` in shared memory (sent to the engine process without another copy)."""
    buf = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    buf.copy_(t.detach())
    return buf


# ----------------------------------------------------------------------------------------------
# The parent-side API


class TorchEngine:
    """The embedded rollout engine (implements :class:`~minippo.engine.RolloutEngine`).

    Args:
        model:          a :class:`minippo.models.Transformer`; the engine builds its own copy from
                        ``model.args`` and ``model.state_dict()`` (the trainer's model is untouched).
        version:        version of these weights (0 at the start of training; the checkpoint's
                        step when resuming).
        in_process:     run the serving loop in a thread of this process instead of a spawned
                        process (same code; for tests and debugging).
        num_threads:    torch threads of the engine process (default: half the cores, 1 on a
                        2-core machine). Ignored in-process.
        device, dtype:  where and in which dtype the engine's copy lives (default: CPU, the
                        model's dtype).
        max_batch_size: most rows decoded together; more waiting requests form the next wave.
        compact:        drop finished rows from the batch (KVCache.keep). False keeps computing
                        them until the whole wave is done (only useful to measure the gain).
        seed:           seeds the per-request seeds of requests without one.
        start_timeout:  seconds to wait for the engine process to build its model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        version: int = 0,
        in_process: bool = False,
        num_threads: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 256,
        compact: bool = True,
        seed: int = 0,
        start_timeout: float = 300.0,
    ) -> None:
        if not hasattr(model, "args") or not hasattr(model, "output"):
            raise TypeError(
                f"TorchEngine needs a minippo.models.Transformer, got {type(model).__name__}"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.args = model.args
        self.max_seq_len = int(model.args.max_seq_len)
        self.in_process = in_process
        self._version = int(version)
        self._ids = itertools.count(1)
        self._pending: dict[int, list] = {}  # call id -> [Event, status, result]
        self._lock = threading.Lock()  # guards _pending and message sends
        self._control = threading.Lock()  # one control operation (publish/pause/...) at a time
        self._closed = False
        self._process = None
        dtype = dtype or next(model.parameters()).dtype
        server_kw = dict(
            version=self._version, seed=seed, max_batch_size=max_batch_size, compact=compact
        )
        if in_process:
            self._inbox: Any = queue_lib.Queue()
            self._outbox: Any = queue_lib.Queue()
            engine_model = copy.deepcopy(model).to(device=device, dtype=dtype)
            server = _Server(engine_model, inbox=self._inbox, outbox=self._outbox, **server_kw)
            self._server_thread = threading.Thread(
                target=server.serve, name="torch-engine", daemon=True
            )
            self._server_thread.start()
        else:
            ctx = mp.get_context("spawn")
            self._inbox = ctx.Queue()
            self._outbox = ctx.Queue()
            spec = {
                "args": model.args,
                # a tied lm_head is the embedding: sent once, re-tied by _build_model
                "state_dict": {
                    k: _shared_copy(v)
                    for k, v in model.state_dict().items()
                    if not (k == "output.weight" and model.args.tie_word_embeddings)
                },
                "device": str(device),
                "dtype": dtype,
                "num_threads": num_threads or default_num_threads(),
                "server": server_kw,
            }
            self._process = ctx.Process(
                target=_serve_in_child, args=(spec, self._inbox, self._outbox), daemon=True
            )
            self._process.start()
            del spec
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

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete ``requests`` (validated first); blocks; thread-safe."""
        requests = list(requests)
        validate_requests(requests, max_seq_len=self.max_seq_len, vocab_size=self.args.vocab_size)
        if not requests:
            return []
        return self._call("generate", requests)

    def publish_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy (HF or native name, tensor) buckets into the engine's weights; stamp ``version``.

        Applied between two decode steps; in-flight rows then re-prefill under the new weights.
        """
        version = int(version)
        if version < self._version:
            raise ValueError(
                f"version must not decrease: got {version}, engine has {self._version}"
            )
        with self._control:
            cid, event = self._open_call()
            self._send("publish_begin", cid, version)
            keep = []  # shared-memory buffers stay alive until the engine has applied them
            try:
                for bucket in buckets:
                    if self.in_process:
                        sent = [(n, t.detach()) for n, t in bucket]
                    else:
                        sent = [(n, _shared_copy(t)) for n, t in bucket]
                        keep.append(sent)
                    self._send("publish_bucket", cid, sent)
            finally:
                self._send("publish_end", cid, None)
            self._wait(cid, event)
            self._version = version

    def pause(self) -> None:
        """Returns once no forward pass runs; in-flight requests keep their state."""
        with self._control:
            self._call("pause", None)

    def resume(self) -> None:
        with self._control:
            self._call("resume", None)

    def abort(self) -> list[Completion]:
        """Stop every in-flight and waiting request; return their partial completions."""
        with self._control:
            return self._call("abort", None)

    def sleep(self) -> None:
        """Move the weights off the accelerator (no-op on CPU); needs an idle engine."""
        with self._control:
            self._call("sleep", None)

    def wake(self) -> None:
        with self._control:
            self._call("wake", None)

    def inflight_tokens(self) -> dict[str, int]:
        """request id -> tokens generated so far, for requests not yet finished."""
        return self._call("progress", None)

    def stats(self) -> dict[str, int | str]:
        """Counters: waves, decode_steps, row_steps (rows summed over steps), reprefills; and
        ``linear_kernel``: ``"onednn_packed"`` (CPU, float32 / bfloat16, weights packed once per
        publish) or ``"torch"`` (the model's own ``nn.Linear`` layers)."""
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
            for entry in self._pending.values():
                entry[1:] = ["error", "the engine was shut down"]
                entry[0].set()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- messaging ---------------------------------------------------------------------------------
    def _open_call(self) -> tuple[int, threading.Event]:
        if self._closed:
            raise RuntimeError("the engine was shut down")
        event = threading.Event()
        with self._lock:
            cid = next(self._ids)
            self._pending[cid] = [event, None, None]
        return cid, event

    def _send(self, kind: str, cid: int, payload: Any) -> None:
        with self._lock:
            self._inbox.put((kind, cid, payload))

    def _call(self, kind: str, payload: Any, timeout: float | None = None) -> Any:
        cid, event = self._open_call()
        self._send(kind, cid, payload)
        return self._wait(cid, event, timeout)

    def _wait(self, cid: int, event: threading.Event, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not event.wait(timeout=1.0):
            if self._process is not None and not self._process.is_alive():
                raise RuntimeError(f"the engine process died (exit code {self._process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"engine call {cid} timed out after {timeout} s")
        with self._lock:
            _, status, result = self._pending.pop(cid)
        if status == "error":
            raise RuntimeError(f"engine error:\n{result}")
        return result

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
                entry = self._pending.get(cid)
                if entry is not None:
                    entry[1:] = [status, result]
                    entry[0].set()


def _shutdown_quietly(inbox: Any, process: Any) -> None:
    """atexit / garbage-collection safety net: stop the engine process if still running."""
    with contextlib.suppress(Exception):
        inbox.put(("shutdown", 0, None))
    if process is not None:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
