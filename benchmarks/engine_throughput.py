"""TorchEngine decode throughput vs HF transformers ``generate()`` on the same model and batch.

The model: a Qwen3 with 4 layers, hidden 256, vocab 32k, random weights, built as a transformers
``Qwen3ForCausalLM``, saved, and loaded into minippo with ``from_pretrained`` (so both sides run
the very same weights). Both generate the same batch of prompts for exactly ``--new-tokens``
tokens (no stop ids, ``min_new_tokens`` on the HF side), with the same sampling (temperature 1,
no top-k / top-p), in this process with the same number of torch threads. TorchEngine runs
in-process (``in_process=True``: the same serving loop as the engine process, without the process
hop) so the two measure compute alike; ``--process`` times the engine process instead.

``--compile`` adds a third contender in the same interleaved runs: ``TorchEngine(compile=True)``
(``torch.compile``d decode step and sampler); it reports its compile time (its first generate
minus the same generate again), its logprob agreement, and the compiled / eager engine ratio.

A second table measures the compaction of finished rows: requests with mixed max_new_tokens,
``compact=True`` (finished rows leave the batch via KVCache.keep) vs ``compact=False``.

    python benchmarks/engine_throughput.py            # 32 prompts x 128 new tokens
    python benchmarks/engine_throughput.py --quick    # seconds
    python benchmarks/engine_throughput.py --compile  # + the compiled engine (compiles ~1 min)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from minippo.engine import GenerateRequest, SamplingParams, TorchEngine
from minippo.models import from_pretrained, token_logprobs
from minippo.parallel import full_tensor_buckets


def build_hf_model(vocab: int, dim: int, layers: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=3 * dim,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=dim // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval()


def twin_models(vocab: int, dim: int, layers: int, seed: int = 0):
    """``(hf, ours)``: a random HF Qwen3 (``build_hf_model``) and the minippo model loaded from
    its saved weights (fp32), so both sides run the very same weights."""
    hf = build_hf_model(vocab=vocab, dim=dim, layers=layers, seed=seed)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = from_pretrained(d, dtype=torch.float32)
    return hf, ours


def make_requests(
    batch: int, prompt_len: int, new_tokens: int, vocab: int = 32_000
) -> tuple[torch.Tensor, list[GenerateRequest]]:
    """``(prompts, requests)``: ``batch`` random prompts of ``prompt_len`` tokens (seed 0) as a
    [batch, prompt_len] tensor for HF and as requests for exactly ``new_tokens`` tokens at
    temperature 1 (request ``i``: id ``r<i>``, sampling seed ``i``)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (batch, prompt_len), generator=gen)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    requests = [
        GenerateRequest(p.tolist(), replace(params, seed=i), f"r{i}") for i, p in enumerate(prompts)
    ]
    return prompts, requests


def run_hf(model, prompts: torch.Tensor, new_tokens: int, seed: int) -> float:
    """Seconds of one HF ``generate()`` of exactly ``new_tokens`` tokens per prompt."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == prompts.shape[1] + new_tokens, out.shape
    return dt


def torch_engine(model, **kw) -> TorchEngine:
    """A TorchEngine built from ``model.args`` (as the recipe builds it) holding ``model``'s
    weights (its first publish)."""
    engine = TorchEngine(model.args, **kw)
    engine.publish_weights(
        full_tensor_buckets(model, bucket_bytes=1 << 26, dtype=engine.dtype), version=0
    )
    return engine


def run_engine(engine, requests) -> tuple[float, int]:
    """Seconds of one ``engine.generate(requests)`` and the number of generated tokens."""
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    return time.perf_counter() - t0, sum(len(c.token_ids) for c in outs)


@torch.no_grad()
def logprob_agreement(engine, model, requests) -> float:
    """max |engine logprob - teacher-forced logprob of ``model``| over ``requests`` (equal
    prompt lengths): the fast decode path must still return the trainer's numbers."""
    outs = engine.generate(requests)
    ids = torch.tensor([list(c.prompt_ids) + list(c.token_ids) for c in outs])
    start = len(outs[0].prompt_ids)
    ref = token_logprobs(model, ids, start=start)
    got = torch.tensor([c.logprobs for c in outs])
    return float((ref - got).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, 1 repeat")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    ap.add_argument("--process", action="store_true", help="time the engine process instead")
    ap.add_argument(
        "--compile", action="store_true", help="also time TorchEngine(compile=True) (A/B/C)"
    )
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.repeats = 8, 16, 1
    torch.set_num_threads(args.threads)

    hf, ours = twin_models(vocab=32_000, dim=256, layers=4, seed=0)
    prompts, requests = make_requests(args.batch, args.prompt_len, args.new_tokens)
    total = args.batch * args.new_tokens

    # mixed lengths for the compaction table: from new_tokens / 8 to new_tokens
    mixed = [
        GenerateRequest(
            r.prompt_ids,
            SamplingParams(max_new_tokens=max(1, args.new_tokens * (1 + i % 8) // 8), seed=i),
            r.request_id,
        )
        for i, r in enumerate(requests)
    ]
    engine = torch_engine(ours, in_process=not args.process, num_threads=args.threads)
    no_compact = torch_engine(
        ours, in_process=not args.process, num_threads=args.threads, compact=False
    )
    compiled = (
        torch_engine(ours, in_process=not args.process, num_threads=args.threads, compile=True)
        if args.compile
        else None
    )
    hf_times, eng_times, comp_times, nocomp_times, cc_times = [], [], [], [], []
    try:
        agreement = logprob_agreement(engine, ours, requests[:8])
        kernel = engine.stats()["linear_kernel"]
        if compiled is not None:
            t0 = time.perf_counter()
            c_agreement = logprob_agreement(compiled, ours, requests[:8])  # compiles here
            t_first = time.perf_counter() - t0
            t_again = run_engine(compiled, requests[:8])[0]
            compile_s = t_first - t_again
        # interleaved runs so that both sides see the same load on shared cores; run 0 warms up
        for r in range(args.repeats + 1):
            t_hf = run_hf(hf, prompts, args.new_tokens, seed=r)
            t_eng, n = run_engine(engine, requests)
            assert n == total, (n, total)
            t_c, n_mixed = run_engine(engine, mixed)
            t_nc, _ = run_engine(no_compact, mixed)
            if compiled is not None:
                t_cc, n = run_engine(compiled, requests)
                assert n == total, (n, total)
                if r:
                    cc_times.append(t_cc)
            if r:
                hf_times.append(t_hf)
                eng_times.append(t_eng)
                comp_times.append(t_c)
                nocomp_times.append(t_nc)
    finally:
        engine.shutdown()
        no_compact.shutdown()
        if compiled is not None:
            compiled.shutdown()

    def row(name: str, times: list[float], n_tokens: int) -> str:
        best, med = min(times), statistics.median(times)
        return f"{name:<34}{n_tokens / best:>12.1f}{n_tokens / med:>14.1f}{med:>10.2f}"

    mode = "process" if args.process else "in-process"
    print(
        f"model: Qwen3 4 layers, hidden 256, vocab 32000 (fp32); batch {args.batch} x "
        f"{args.prompt_len} prompt tokens, {args.new_tokens} new tokens, T=1.0; "
        f"torch threads {args.threads}; {args.repeats} interleaved runs after a warm-up"
    )
    print(
        f"engine linear kernels: {kernel}; max |engine - teacher-forced| logprob (fp32, 8 "
        f"prompts): {agreement:.2g}"
    )
    print(f"{'generator':<34}{'best tok/s':>12}{'median tok/s':>14}{'median s':>10}")
    print(row("HF transformers generate()", hf_times, total))
    print(row(f"TorchEngine ({mode})", eng_times, total))
    best = min(hf_times) / min(eng_times)
    med = statistics.median(hf_times) / statistics.median(eng_times)
    print(f"ratio TorchEngine / HF: {best:.2f}x (best runs), {med:.2f}x (medians)")
    if compiled is not None:
        print(row(f"TorchEngine compile=True ({mode})", cc_times, total))
        for name, base in (("HF", hf_times), ("TorchEngine", eng_times)):
            best = min(base) / min(cc_times)
            med = statistics.median(base) / statistics.median(cc_times)
            print(
                f"ratio TorchEngine compile=True / {name}: {best:.2f}x (best runs), "
                f"{med:.2f}x (medians)"
            )
        print(
            f"compile=True: compile time {compile_s:.1f} s (first generate of 8 prompts minus "
            f"the same again); max |engine - teacher-forced| logprob: {c_agreement:.2g}"
        )
    print(
        f"\ncompaction: {args.batch} requests, max_new_tokens from {args.new_tokens // 8} to "
        f"{args.new_tokens} ({n_mixed} tokens)"
    )
    print(row("TorchEngine compact=True", comp_times, n_mixed))
    print(row("TorchEngine compact=False", nocomp_times, n_mixed))
    print(
        f"compaction speed-up: {min(nocomp_times) / min(comp_times):.2f}x (best runs), "
        f"{statistics.median(nocomp_times) / statistics.median(comp_times):.2f}x (medians)"
    )


if __name__ == "__main__":
    main()
