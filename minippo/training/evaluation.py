"""Evaluation of a policy on a prompt set: mean reward, pass@k, response lengths, truncation.

The eval recipe (``recipes/eval.py``) and validation between training steps call the same
:func:`evaluate`; docs/eval.md has the metrics, the pass@k formula and the jsonl fields.

    result = evaluate(engine, dataset, reward_fn=reward, decode=tokenizer.decode,
                      sampling=SamplingParams(temperature=1.0, max_new_tokens=512),
                      samples_per_prompt=8, seed=0)
    result.metrics   # {"eval/reward_mean": ..., "eval/pass@1": ..., "eval/pass@8": ..., ...}
    rows = gather_samples(result.samples)            # every rank's rows on rank 0
    write_samples(rows, "samples.jsonl")             # rank 0: one JSON line per sample

What it does: sample ``k = samples_per_prompt`` responses per prompt from the engine's current
weights, decode each, score it with ``reward_fn(example, text)``, and count it correct when its
reward reaches ``correct_threshold`` (default: the reward's ``max_value``, 1.0 for the built-in
rewards). pass@k per prompt is the unbiased estimator of Chen et al. 2021 (:func:`pass_at_k`),
averaged over prompts.

Determinism and side effects: sample ``j`` of the prompt at position ``i`` of ``examples`` is
requested with its own seed ``(seed * 1_000_003 + i * k + j) mod 2**62``, whatever the number of
ranks, and nothing else draws a random number: no global RNG (torch, CUDA, Python ``random``) is
read or advanced and no model or optimizer is touched, so a training run that validates trains
exactly like one that does not. TorchEngine gives the same tokens for the same seeded request in
any batch (up to the floating-point differences of batched matmuls); SGLang only with
``enable_deterministic_inference``.

Ranks: under torch.distributed, rank ``r`` of ``W`` evaluates the prompts at positions
``r, r + W, r + 2W, ...``; the per-prompt statistics of every rank are gathered
(``all_gather_object``) and every rank computes the same metrics from all of them with
``math.fsum`` (correctly rounded, so independent of the order and of the number of ranks: 2
ranks give the bits of 1 rank when they sample the same tokens). Every rank must call
:func:`evaluate` (and :func:`gather_samples`), each with the whole ``examples``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
from tqdm import tqdm

from minippo.engine.protocol import GenerateRequest, RolloutEngine, SamplingParams
from minippo.training.rollout_queue import (
    RolloutSample,
    prompt_ids_of,
    run_episodes,
    sample_seed,
    score_sample,
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. (1): the chance
    that a random subset of ``k`` of the ``n`` samples holds at least one correct one,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    computed in the product form (no large binomials); 1.0 when ``n - c < k`` (every subset of
    ``k`` holds a correct sample). pass@1 = c / n.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"pass_at_k: {name} must be an int, got {v!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c ({c}) <= n ({n})")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k ({k}) <= n ({n}) samples")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i
    return 1.0 - prod


@dataclass(frozen=True)
class EvalSample:
    """One sample (one line of the eval recipe's jsonl).

    Fields:
        prompt_index:  the prompt's position in the evaluated ``examples`` (its
                       ``PromptExample.index`` when ``examples`` is a whole dataset).
        sample:        which of the prompt's ``samples_per_prompt`` samples (0-based).
        prompt:        the prompt text (after the chat template).
        answer:        the reference answer the reward compared with.
        response:      the decoded response (special tokens removed).
        reward:        the reward of the response.
        correct:       reward >= the correctness threshold (what pass@k counts).
        response_len:  generated tokens (a final stop token included).
        finish_reason: "stop" (a stop token) or "length" (cut at max_new_tokens).
    """

    prompt_index: int
    sample: int
    prompt: str
    answer: str
    response: str
    reward: float
    correct: bool
    response_len: int
    finish_reason: str


@dataclass
class EvalResult:
    """What :func:`evaluate` returns.

    Fields:
        metrics: ``{prefix}reward_mean``, ``{prefix}pass@{k}`` for each k, ``{prefix}
                 response_len_mean``, ``{prefix}truncated_frac``, ``{prefix}prompts``,
                 ``{prefix}samples``: over every rank's prompts, the same on every rank.
        samples: this rank's samples, ordered by (prompt_index, sample).
        seconds: this rank's wall time (generation and scoring).
    """

    metrics: dict[str, float]
    samples: list[EvalSample]
    seconds: float


def evaluate(
    engine: RolloutEngine,
    examples: Sequence[Any],
    *,
    reward_fn: Callable[[Any, str], float],
    decode: Callable[[list[int]], str],
    sampling: SamplingParams,
    samples_per_prompt: int,
    seed: int = 0,
    pass_k: Iterable[int] | None = None,
    correct_threshold: float | None = None,
    prefix: str = "eval/",
    on_sample: Callable[[EvalSample], None] | None = None,
    progress: bool = False,
    multi_turn: Any = None,
) -> EvalResult:
    """Sample, score and summarise; see the module docstring. Collective under torch.distributed.

    Args:
        engine: a :class:`~minippo.engine.RolloutEngine` holding the weights to evaluate.
        examples: the prompts, every rank the same sequence (each takes its share): objects with
            ``prompt_ids``, ``prompt`` and ``answer`` (:class:`~minippo.data.PromptExample`).
        reward_fn: ``reward_fn(example, response_text) -> float`` (a ``reward`` component).
        decode: token ids -> text (a tokenizer's ``decode``).
        sampling: how to sample; its ``seed`` is replaced per request (module docstring).
        samples_per_prompt: samples per prompt, the ``n`` of pass@k.
        seed: base of the per-request seeds.
        pass_k: the k of the ``pass@k`` metrics, each in [1, samples_per_prompt]; default
            ``(1, samples_per_prompt)``.
        correct_threshold: a sample is correct when its reward is >= this; default the reward's
            ``max_value`` (1.0 when it has none).
        prefix: the metrics' namespace (``"eval/"``; e.g. ``"val/"`` inside training).
        on_sample: called with each scored sample as it finishes (finishing order).
        progress: show a tqdm bar over this rank's samples (pass it on one rank only).
        multi_turn: a :class:`minippo.env.MultiTurn`: every sample is an episode of its
            environment, run as the rollout queue runs them (``run_episodes``); the reward is
            the environment's (else ``reward_fn``'s), ``response_len`` counts model tokens and
            the metrics add ``turns_mean``.
    """
    n = samples_per_prompt
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"samples_per_prompt must be an integer >= 1, got {n!r}")
    if len(examples) == 0:
        raise ValueError("evaluate: no examples to evaluate")
    ks = sorted(set(pass_k if pass_k is not None else (1, n)))
    bad = [k for k in ks if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n]
    if bad or not ks:
        raise ValueError(
            f"pass_k must be integers in [1, samples_per_prompt ({n})], got {list(ks)}; e.g. "
            f"pass_k=[1, {n}]"
        )
    if correct_threshold is None:
        correct_threshold = getattr(reward_fn, "max_value", 1.0)
    threshold = float(correct_threshold)
    rank, world = _rank_and_world()
    positions = range(rank, len(examples), world)
    requests: list[GenerateRequest] = []
    where: dict[str, tuple[int, int]] = {}  # request id -> (prompt position, sample)
    for i in positions:
        ids = prompt_ids_of(examples[i])
        for j in range(n):
            params = replace(sampling, seed=sample_seed(seed, i * n + j))
            requests.append(GenerateRequest(ids, params, request_id=f"eval-{i}-{j}"))
            where[requests[-1].request_id] = (i, j)

    reward_name = _name(reward_fn)
    t0 = time.perf_counter()
    out: dict[tuple[int, int], EvalSample] = {}
    if multi_turn is not None:
        episodes = run_episodes(
            engine, [(i, examples[i]) for i in positions], samples_per_prompt=n,
            sampling=sampling, multi_turn=multi_turn, seed=seed, decode=decode,
            reward_fn=lambda s: reward_fn(s.prompt, s.text), reward_name=reward_name,
        )  # fmt: skip
        turns = {}
        for e in episodes:
            i, j = divmod(e.sample_index, n)
            c = e.completion
            row = EvalSample(
                prompt_index=i, sample=j, prompt=str(getattr(e.prompt, "prompt", "")),
                answer=str(getattr(e.prompt, "answer", "")), response=e.text or "",
                reward=float(e.reward), correct=float(e.reward) >= threshold,
                response_len=sum(v >= 0 for v in c.versions), finish_reason=c.finish_reason,
            )  # fmt: skip
            out[(i, j)], turns[(i, j)] = row, e.turns
            if on_sample is not None:
                on_sample(row)
        requests = [None] * len(out)  # every episode ran to its end
    bar = tqdm(
        total=len(requests), desc="eval", unit="sample", disable=not progress, dynamic_ncols=True
    )
    reward_sum = 0.0
    try:
        for c in engine.stream(requests) if requests and multi_turn is None else ():
            i, j = where[c.request_id]
            if c.finish_reason == "abort":
                raise RuntimeError(
                    f"eval request {c.request_id} was aborted (engine.abort() during an "
                    "evaluation); evaluate again once the engine is free"
                )
            example, text = examples[i], decode(list(c.token_ids))
            scored = RolloutSample(example, list(c.prompt_ids), c, text, None, i, i * n + j)
            reward = score_sample(lambda s: reward_fn(s.prompt, s.text), reward_name, scored)
            row = EvalSample(
                prompt_index=i,
                sample=j,
                prompt=str(getattr(example, "prompt", "")),
                answer=str(getattr(example, "answer", "")),
                response=text,
                reward=reward,
                correct=reward >= threshold,
                response_len=len(c.token_ids),
                finish_reason=c.finish_reason,
            )
            out[(i, j)] = row
            if on_sample is not None:
                on_sample(row)
            reward_sum += reward
            bar.set_postfix(reward=f"{reward_sum / len(out):.3f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
    if len(out) != len(requests):
        missing = [r.request_id for r in requests if where[r.request_id] not in out]
        raise RuntimeError(
            f"eval: the engine returned no completion for {len(missing)} of {len(requests)} "
            f"requests ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            "every request must finish or be aborted"
        )
    samples = [out[key] for key in sorted(out)]
    seconds = time.perf_counter() - t0

    # every rank's per-prompt statistics, in prompt order
    per_prompt = []
    for p, i in enumerate(positions):
        mine = samples[p * n : (p + 1) * n]
        per_prompt.append(
            _PromptStats(
                position=i,
                rewards=[s.reward for s in mine],
                correct=sum(s.correct for s in mine),
                lengths=[s.response_len for s in mine],
                truncated=sum(s.finish_reason == "length" for s in mine),
                turns=tuple(turns[(i, j)] for j in range(n)) if multi_turn is not None else (),
            )
        )
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, per_prompt)
        per_prompt = sorted((st for part in gathered for st in part), key=lambda st: st.position)
    return EvalResult(_summary(per_prompt, n, ks, prefix), samples, seconds)


class _PromptStats(NamedTuple):
    """What the metrics need of one prompt's n samples (gathered from every rank)."""

    position: int  # in ``examples``
    rewards: list[float]  # n
    correct: int  # c of pass@k
    lengths: list[int]  # n, generated tokens
    truncated: int  # samples cut at max_new_tokens
    turns: tuple[int, ...] = ()  # n model turns of multi-turn episodes (empty: single-turn)


def _summary(
    per_prompt: list[_PromptStats], n: int, ks: list[int], prefix: str
) -> dict[str, float]:
    """The metrics of every prompt's statistics (``math.fsum``: exact sums, any order)."""
    prompts = len(per_prompt)
    total = prompts * n
    metrics = {f"{prefix}reward_mean": math.fsum(r for p in per_prompt for r in p.rewards) / total}
    for k in ks:  # mean over prompts of the unbiased per-prompt estimate
        passed = math.fsum(pass_at_k(n, p.correct, k) for p in per_prompt)
        metrics[f"{prefix}pass@{k}"] = passed / prompts
    lengths = math.fsum(x for p in per_prompt for x in p.lengths)
    metrics[f"{prefix}response_len_mean"] = lengths / total
    metrics[f"{prefix}truncated_frac"] = math.fsum(p.truncated for p in per_prompt) / total
    if any(p.turns for p in per_prompt):
        metrics[f"{prefix}turns_mean"] = math.fsum(t for p in per_prompt for t in p.turns) / total
    metrics[f"{prefix}prompts"] = float(prompts)
    metrics[f"{prefix}samples"] = float(total)
    return metrics


def gather_samples(samples: Sequence[EvalSample]) -> list[EvalSample]:
    """Every rank's samples on rank 0, ordered by (prompt_index, sample); ``[]`` on the other
    ranks; ``samples`` itself (ordered) in a single process. Collective under torch.distributed."""
    _, world = _rank_and_world()
    if world == 1:
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample))
    parts: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(list(samples), parts, dst=0)
    if parts is None:
        return []
    return sorted((s for part in parts for s in part), key=lambda s: (s.prompt_index, s.sample))


def write_samples(samples: Iterable[EvalSample], path: str | os.PathLike) -> Path:
    """Write one JSON object per sample (the :class:`EvalSample` fields) to ``path`` atomically
    (a reader sees the old file or the whole new one); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(asdict(s), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_samples(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows :func:`write_samples` wrote, as dicts."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_metrics(metrics: Mapping[str, float]) -> str:
    """The metrics as aligned ``name  value`` lines (what the eval recipe prints)."""
    width = max(len(k) for k in metrics)
    lines = []
    for k, v in metrics.items():
        shown = f"{int(v)}" if k.endswith(("/prompts", "/samples")) else f"{v:.4f}"
        lines.append(f"  {k:<{width}}  {shown}")
    return "\n".join(lines)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _name(fn: Any) -> str:
    """A callable's name for messages: a function's qualified name, else its class's."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__
