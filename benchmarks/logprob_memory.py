"""Peak memory of per-token logprobs with backward: naive full logits vs chunked token_logprobs.

naive:    logits = model(tokens) [B, S, V] fp32 -> log_softmax(logits / T) -> gather -> backward
chunked:  minippo.models.token_logprobs (lm_head chunk by chunk, each chunk checkpointed)
fused:    minippo.models.fused_policy_loss with inputs that make its gradient that of Σ logprobs
          (each chunk's gradient formed in the forward pass, nothing recomputed)

Each variant runs in a fresh subprocess on CPU; reported per variant:
  peak tensor memory  the most bytes held at once, during forward + backward, by tensors created
                      in that step (activations, logits, gradients; the model and batch exist
                      before), tracked op by op with a TorchDispatchMode over tensor storages
  saved for backward  bytes of activations autograd keeps between forward and backward
                      (torch.autograd.graph.saved_tensors_hooks, each storage counted once,
                      parameters excluded)
  peak RSS growth     ru_maxrss at the end minus RSS before the step (allocator noise included)
  time                forward + backward seconds (the tracker slows both variants alike)
and the max |diff| between the two variants' logprobs and gradients.

    python benchmarks/logprob_memory.py            # B=2, S=1024, V=151936 (Qwen3 vocabulary)
    python benchmarks/logprob_memory.py --quick    # B=2, S=128, V=32768, chunk_size=64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from _common import TensorMemoryTracker, rss_bytes

VARIANTS = ("naive", "chunked", "fused")


def _build(args):
    from minippo.models import ModelArgs, Transformer, init_weights

    margs = ModelArgs(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=args.dim // 4,
        intermediate_size=2 * args.dim,
        tie_word_embeddings=True,
    )
    model = init_weights(Transformer(margs), seed=0)
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    return model, tokens


def _naive(model, tokens, T, start):
    logits = model(tokens).float()
    lp = torch.log_softmax(logits[:, start - 1 : -1] / T, dim=-1)
    return lp.gather(-1, tokens[:, start:, None]).squeeze(-1)


def _chunked(model, tokens, T, start, chunk_size):
    from minippo.models import token_logprobs

    return token_logprobs(model, tokens, temperature=T, start=start, chunk_size=chunk_size)


def _fused(model, tokens, T, start, chunk_size):
    """The fused PPO loss with inputs that make its gradient that of Σ logprobs: anchors = the
    logprobs themselves (r = 1, inside the clip), A = −1, token-mean over a global count of 1, so
    L_t = r_t and ∂loss/∂lp_t = 1. Returns (loss, logprobs)."""
    from minippo.models import FusedLossSpec, fused_policy_loss, token_logprobs

    with torch.no_grad():
        anchor = token_logprobs(model, tokens, temperature=T, start=start, chunk_size=chunk_size)
    ones = torch.ones_like(anchor)
    spec = FusedLossSpec(
        anchor_logprobs=anchor,
        advantages=-ones,
        response_mask=ones,
        global_tokens=torch.tensor(1.0),
    )
    out = fused_policy_loss(model, tokens, spec, temperature=T, start=start, chunk_size=chunk_size)
    return out.loss, out.logprobs


def run_variant(args) -> dict:
    torch.manual_seed(0)
    model, tokens = _build(args)

    def step():
        """(the scalar to backpropagate, the logprobs)"""
        if args.variant == "naive":
            lp = _naive(model, tokens, 0.7, 1)
        elif args.variant == "chunked":
            lp = _chunked(model, tokens, 0.7, 1, args.chunk_size)
        else:
            return _fused(model, tokens, 0.7, 1, args.chunk_size)
        return lp.sum(), lp

    # warm-up on a short batch so that one-off allocations are not counted
    step_tokens = tokens
    tokens = tokens[:, :8]
    step()[0].backward()
    tokens = step_tokens
    model.zero_grad(set_to_none=False)

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    base = rss_bytes() / 2**20
    tracker = TensorMemoryTracker()  # counts only what the step creates (nothing tracked before)
    t0 = time.perf_counter()
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, lp = step()
        loss.backward()
    elapsed = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {
        "peak_tensor_mib": tracker.peak.get("cpu", 0) / 2**20,
        "peak_rss_growth_mib": peak_rss - base,
        "saved_mib": sum(seen.values()) / 2**20,
        "time_s": elapsed,
        "logprobs": lp.detach().flatten()[:4096].tolist(),
        "grad": model.layers[0].attention.wq.weight.grad.flatten()[:4096].tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="small sizes (seconds): S=128, V=32768, chunk_size=64"
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.seq is None:
        args.seq = 128 if args.quick else 1024
    if args.quick:  # seconds, to keep the script working; not the documented figures
        args.vocab, args.chunk_size = 32_768, 64

    if args.variant:  # child process
        print(json.dumps(run_variant(args)))
        return

    results = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            *[
                f"--{k}={v}"
                for k, v in [
                    ("batch", args.batch),
                    ("seq", args.seq),
                    ("vocab", args.vocab),
                    ("dim", args.dim),
                    ("chunk-size", args.chunk_size),
                ]
            ],
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    n, c, f = results["naive"], results["chunked"], results["fused"]
    lp_diff = max(abs(a - b) for a, b in zip(n["logprobs"], c["logprobs"]))
    g_diff = max(abs(a - b) for a, b in zip(n["grad"], c["grad"]))
    f_lp_diff = max(abs(a - b) for a, b in zip(n["logprobs"], f["logprobs"]))
    f_g_diff = max(abs(a - b) for a, b in zip(n["grad"], f["grad"]))
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"B={args.batch} S={args.seq} V={args.vocab} D={args.dim} chunk_size={args.chunk_size}  "
        f"(one fp32 [B,S,V] logits tensor = {logits_mib:.0f} MiB)"
    )
    print(
        "| variant | peak tensor memory (MiB) | saved for backward (MiB) "
        "| peak RSS growth (MiB) | fwd+bwd (s) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['peak_tensor_mib']:.0f} | {r['saved_mib']:.0f} "
            f"| {r['peak_rss_growth_mib']:.0f} | {r['time_s']:.2f} |"
        )
    print(
        f"peak tensor memory saved: {n['peak_tensor_mib'] - c['peak_tensor_mib']:.0f} MiB "
        f"({n['peak_tensor_mib'] / max(c['peak_tensor_mib'], 1e-9):.1f}x less); "
        f"max |diff| logprobs {lp_diff:.1e}, grads {g_diff:.1e}"
    )
    print(
        f"fused vs naive: peak tensor memory ratio {f['peak_tensor_mib'] / n['peak_tensor_mib']:.3f}"
        f", fwd+bwd time ratio {f['time_s'] / n['time_s']:.2f}; max |diff| logprobs "
        f"{f_lp_diff:.1e}, grads {f_g_diff:.1e}"
    )


if __name__ == "__main__":
    main()
