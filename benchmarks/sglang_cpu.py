"""The real SGLang engine on a CPU against TorchEngine: decode tokens/s and publish seconds per MiB.

Both engines run the same random Qwen3 weights (fp32), each in its own process (SGLang's scheduler;
TorchEngine's engine process) with the same number of threads, and generate the same batch of
prompts for exactly ``--new-tokens`` tokens each (no stop ids), at temperature 1. The runs are
interleaved (SGLang, TorchEngine, SGLang, ...); the table gives the median of each and the ratio.
Publish: ``publish_weights`` of the whole model (fp32 buckets of 64 MiB, as the recipe) through
each backend's path (SGLang: serialised shared-memory tensors into ``update_weights_from_tensor``
inside a weight-update session, flush, version stamp), seconds per MiB.

Runs in the environment of ``scripts/sglang_cpu_env.sh`` (SGLang imported there)::

    VENV/bin/python benchmarks/sglang_cpu.py                 # tiny and small model, 5 rounds
    VENV/bin/python benchmarks/sglang_cpu.py --quick         # one round of the tiny model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minippo.engine import GenerateRequest, SamplingParams, TorchEngine
from minippo.engine.sglang_engine import SGLangEngine
from minippo.models import ModelArgs, Transformer, init_weights, qwen3_tiny
from minippo.parallel import full_tensor_buckets

try:  # as a script: benchmarks/ is on sys.path
    from _common import machine, markdown_table
except ImportError:  # as a module (python -m benchmarks.sglang_cpu, tests)
    from benchmarks._common import machine, markdown_table


def small_model() -> ModelArgs:
    """A Qwen3 with 4 layers, hidden 256 and a 32k vocabulary (~10M parameters, 40 MiB fp32):
    big enough that a publish moves tens of MiB and a decode step is more than overhead."""
    return ModelArgs(
        vocab_size=32_000,
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        intermediate_size=768,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=2048,
        tie_word_embeddings=True,
    )


def requests(args: ModelArgs, batch: int, prompt_len: int, new_tokens: int) -> list:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, args.vocab_size, (batch, prompt_len), generator=gen)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    return [GenerateRequest(p.tolist(), params, f"r{i}") for i, p in enumerate(prompts)]


def publish_s(engine, model: torch.nn.Module, version: int) -> float:
    buckets = full_tensor_buckets(model, bucket_bytes=64 << 20, dtype=engine.dtype)
    start = time.perf_counter()
    engine.publish_weights(buckets, version=version)
    return time.perf_counter() - start


def measure(name: str, args: ModelArgs, *, rounds: int, batch: int, prompt_len: int,
            new_tokens: int, threads: int, base_port: int) -> list[list[object]]:  # fmt: skip
    model = init_weights(Transformer(args), seed=0, std=0.02).eval()
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    engines = {
        "SGLang 0.5.23 (CPU)": SGLangEngine(
            None, model_args=args, device="cpu", dtype="float32", cpu_threads=threads,
            context_length=prompt_len + new_tokens, base_port=base_port,
        ),
        "TorchEngine": TorchEngine(args, dtype="float32", num_threads=threads),
    }  # fmt: skip
    reqs = requests(args, batch, prompt_len, new_tokens)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    pubs: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for engine in engines.values():  # warm-up: first publish and one generate
            publish_s(engine, model, 0)
            engine.generate(reqs[:2])
        for r in range(rounds):
            for key, engine in engines.items():
                pubs[key].append(publish_s(engine, model, r + 1) / mib)
                start = time.perf_counter()
                outs = engine.generate(reqs)
                seconds = time.perf_counter() - start
                assert all(len(c.token_ids) == new_tokens for c in outs)
                rates[key].append(batch * new_tokens / seconds)
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = []
    base = statistics.median(rates["TorchEngine"])
    for key in engines:
        rows.append(
            [
                name,
                key,
                f"{mib:.1f}",
                f"{statistics.median(rates[key]):.0f}",
                f"{statistics.median(rates[key]) / base:.2f}",
                f"{statistics.median(pubs[key]) * 1000:.1f}",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    ap.add_argument("--base-port", type=int, default=32000, help="the SGLang engine's ports")
    ap.add_argument("--quick", action="store_true", help="one round of the tiny model, 8 x 8")
    a = ap.parse_args()
    models = [("tiny (qwen3_tiny)", qwen3_tiny()), ("small (4 x 256, 32k vocab)", small_model())]
    kw = dict(rounds=a.rounds, batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
    if a.quick:
        models, kw = models[:1], dict(rounds=1, batch=8, prompt_len=8, new_tokens=8)
    print(machine())
    print(f"batch {kw['batch']} x {kw['new_tokens']} new tokens, prompts of {kw['prompt_len']}, "
          f"{a.threads} thread(s) per engine, {kw['rounds']} interleaved rounds (medians)")  # fmt: skip
    rows = []
    for name, args in models:
        rows += measure(name, args, threads=a.threads, base_port=a.base_port, **kw)
    headers = ["model", "engine", "MiB (fp32)", "decode tok/s", "x TorchEngine", "publish ms/MiB"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
