"""The performance figures of DESIGN.md "Numbers that matter", each a ratio measured side by side
in one run (both sides interleaved, so that a busy machine slows both alike).

1. engine:     TorchEngine decode tokens/s vs HF transformers ``generate()`` (goal >= 2x);
               the measurement functions of benchmarks/engine_throughput.py.
2. async:      the recipe on tiny_cpu with max_staleness=1 vs max_staleness=0, otherwise
               identical, steps/s (goal >= 1.6x when rollout time ~ training time). The phase
               times of both runs come from the metrics (perf/*, rollout/gen_time_s).
3. correction: EWMA update and snapshot save/swap vs a plain copy of the same bytes
               (goal <= 1.5x); benchmarks/correction_cost.py's paired timing.
4. ppo update: tokens/s of one PPO update (forward + backward + optimizer step) of minippo
               (Transformer + chunked token_logprobs + rl.policy_loss) vs a straightforward
               transformers implementation (Qwen3ForCausalLM, full [B, S, V] logits,
               log_softmax + gather, the same clipped loss written out), same weights, batch,
               optimizer (torch.optim.AdamW) and torch threads. A second row times the same
               update with ``models.fused_policy_loss`` (lm_head and loss fused, no recompute,
               chunks of FUSED_CHUNK_SIZE tokens; goal >= 1x), and a third compares the peak bytes of the tensors forward +
               backward create, fused vs transformers (goal <= 1/3). A fourth side is the fused
               update with activation checkpointing per decoder block (the config's
               ``activation_checkpointing: true``): its speed and peak bytes against the same
               transformers side.
5. compile:    the fused-loss PPO update (forward + backward + AdamW step) with every decoder
               block compiled (the config's ``compile: true``, ``parallel.compile_blocks``) vs
               the same update eager, on the 19M-parameter model of benchmarks/vs_trl.py's long
               workload (hidden 512, 6 layers, 8 x 134 tokens). Compiling takes tens of seconds,
               so ``--quick`` leaves this section out unless ``--only compile`` asks for it.

    python benchmarks/perf.py --quick       # seconds
    python benchmarks/perf.py               # the figures in docs/benchmarks.md
    python benchmarks/perf.py --only ppo    # one section (engine, async, correction, ppo, compile)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _common import (
    DEFAULT_OUT,
    TINY_CPU_AS_MEASURED,
    TensorMemoryTracker,
    load_average,
    machine,
    markdown_table,
    run_recipe,
)

SECTIONS = ("engine", "async", "correction", "ppo", "compile")


# ------------------------------------------------------------------------------ 1. engine
def engine_vs_hf(quick: bool, threads: int) -> list[list]:
    import engine_throughput as et

    batch, prompt_len, new, repeats = (8, 16, 16, 1) if quick else (32, 32, 128, 3)
    hf, ours = et.twin_models(vocab=32_000, dim=256, layers=4, seed=0)
    prompts, requests = et.make_requests(batch, prompt_len, new)
    engine = et.torch_engine(ours, in_process=True, num_threads=threads)
    hf_t, eng_t = [], []
    try:
        for r in range(repeats + 1):  # run 0 warms up
            t_hf = et.run_hf(hf, prompts, new, seed=r)
            t_eng, n = et.run_engine(engine, requests)
            assert n == batch * new, (n, batch * new)
            if r:
                hf_t.append(t_hf)
                eng_t.append(t_eng)
    finally:
        engine.shutdown()
    total = batch * new
    hf_tps, eng_tps = total / statistics.median(hf_t), total / statistics.median(eng_t)
    print(
        f"Qwen3 4 layers, hidden 256, vocab 32000, fp32; batch {batch} x {prompt_len} prompt "
        f"tokens, {new} new tokens, T=1; {threads} thread(s); median of {repeats}"
    )
    return [["engine decode tokens/s", f"{eng_tps:.0f}", f"{hf_tps:.0f}", eng_tps / hf_tps, ">= 2"]]


# ------------------------------------------------------------------------------ 2. async
def async_vs_sync(quick: bool, threads: int, new_tokens: int, out: Path) -> list[list]:
    """Steps/s of the recipe at max_staleness 1 vs 0 (interleaved runs, medians of steps)."""
    steps, warm, repeats = (3, 1, 1) if quick else (40, 5, 2)
    common = [
        f"total_steps={steps}",
        "rollout.stop_at_eos=false",  # fixed-length responses: the same work in every step
        f"rollout.max_new_tokens={new_tokens}",
        # critic-free: with a critic the update phase is ~2.5x the rollout phase at any length
        "advantage_estimator=grpo",
        *TINY_CPU_AS_MEASURED,
    ]
    if quick:
        common += ["rollout.groups_per_batch=8", "ppo.micro_batch_size=8"]
    per = {0: [], 1: []}
    phases = {0: [], 1: []}

    def one(rep: int, s: int):
        return run_recipe(
            [*common, f"rollout.max_staleness={s}"], out / f"async_s{s}_r{rep}", threads=threads
        )

    runs = []
    if quick:  # both at once: the quick figures only check that the code runs, not the timing
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = list(pool.map(lambda s: (s, one(0, s)), (0, 1)))
    for rep in range(repeats):
        for s in (0, 1):
            run = dict(runs)[s] if quick else one(rep, s)
            if run.returncode != 0:
                raise RuntimeError(f"recipe run failed (max_staleness={s}):\n{run.log_tail}")
            step_s = run.series("perf/step_s")[warm:]
            per[s].append(len(step_s) / sum(step_s))
            phases[s].append(
                {
                    k: statistics.median(run.series(k)[warm:])
                    for k in (
                        "rollout/gen_time_s",
                        "perf/rewards_and_wait_s",
                        "perf/prepare_s",
                        "perf/train_s",
                        "perf/publish_s",
                        "perf/step_s",
                    )
                }
            )
    sync, asyn = statistics.median(per[0]), statistics.median(per[1])
    print(
        f"tiny_cpu with grpo, {new_tokens} new tokens per response (no stop), {steps} steps per "
        f"run, first {warm} skipped, {repeats} run(s) per setting interleaved; trainer {threads} thread(s), "
        "engine process 1 thread"
    )
    heads = [
        "max_staleness",
        "steps/s",
        "generate s",
        "wait s",
        "prepare s",
        "train s",
        "publish s",
        "step s",
    ]
    rows = []
    for s in (0, 1):
        ph = {k: statistics.median(p[k] for p in phases[s]) for k in phases[s][0]}
        rows.append([s, f"{statistics.median(per[s]):.3f}", *(f"{v:.3f}" for v in ph.values())])
    print(markdown_table(heads, rows))
    ph0 = {k: statistics.median(p[k] for p in phases[0]) for k in phases[0][0]}
    train = ph0["perf/prepare_s"] + ph0["perf/train_s"] + ph0["perf/publish_s"]
    print(
        f"synchronous run: rollout {ph0['rollout/gen_time_s']:.3f} s vs training "
        f"(prepare + train + publish) {train:.3f} s per step: ratio "
        f"{ph0['rollout/gen_time_s'] / train:.2f}"
    )
    return [["async / sync steps/s", f"{asyn:.3f}", f"{sync:.3f}", asyn / sync, ">= 1.6"]]


# ------------------------------------------------------------------------------ 3. correction
def correction_vs_copy(quick: bool) -> list[list]:
    import correction_cost as cc

    rows = []
    for name, t, ratio in cc.copy_costs(quick):
        if "per copy" in name:
            name = "snapshot swap, per copy"
        elif "cycle" in name:  # 3 copies against 1: the per-copy row compares like with like
            continue
        rows.append([name, f"{t * 1e3:.1f} ms", "plain copy", ratio, "<= 1.5"])
    return rows


# ------------------------------------------------------------------------------ 4. ppo update
def ppo_batch(B: int, P: int, R: int, vocab: int, seed: int = 0) -> dict:
    """Left-padded prompts (lengths P/2..P) | right-padded responses (lengths R/2..R)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(P // 2, P + 1, (B,), generator=g)
    rlen = torch.randint(R // 2, R + 1, (B,), generator=g)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)
    col = torch.arange(P + R)
    attn = (col >= P - plen[:, None]) & (col < P + rlen[:, None])
    ids = ids * attn
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0) * attn
    resp = attn[:, P:].float()
    adv = torch.randn(B, R, generator=g) * resp
    return {"ids": ids, "attn": attn, "pos": pos, "resp": resp, "adv": adv, "P": P}


def hf_logprobs(model, b: dict) -> torch.Tensor:
    """Straightforward logprobs: full [B, S, V] logits, log_softmax, gather. [B, R]"""
    logits = model(
        input_ids=b["ids"], attention_mask=b["attn"].long(), position_ids=b["pos"]
    ).logits.float()
    P = b["P"]
    logp = torch.log_softmax(logits[:, P - 1 : -1], dim=-1)
    return logp.gather(-1, b["ids"][:, P:, None]).squeeze(-1)


def hf_ppo_loss(logp, old, adv, mask, eps=0.2) -> torch.Tensor:
    """The clipped PPO loss written out: token mean of max(-r A, -clip(r, 1-eps, 1+eps) A)."""
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps) * adv)
    return (per_token * mask).sum() / mask.sum()


# tokens per lm_head chunk of the fused side: two [chunk, V] float32 buffers live at a time
FUSED_CHUNK_SIZE = 256


class _NoStep:
    """An optimizer's ``zero_grad`` without its ``step``: a step's forward and backward alone."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


def ppo_update(quick: bool, threads: int) -> list[list]:
    import engine_throughput as et

    from minippo.models import FusedLossSpec, fused_policy_loss, token_logprobs
    from minippo.models.logprobs import DEFAULT_CHUNK_SIZE
    from minippo.parallel import apply_activation_checkpointing
    from minippo.rl import policy_loss

    vocab, dim, layers = (8_000, 128, 2) if quick else (32_000, 256, 4)
    B, P, R = (4, 16, 32) if quick else (8, 64, 192)
    iters = 2 if quick else 5
    hf, ours = et.twin_models(vocab=vocab, dim=dim, layers=layers, seed=0)
    fused = copy.deepcopy(ours)  # the same weights, its own optimizer
    fused_ac = apply_activation_checkpointing(copy.deepcopy(ours))
    for m in (hf, ours, fused, fused_ac):
        m.train()
    b = ppo_batch(B, P, R, vocab)
    with torch.no_grad():
        old = token_logprobs(
            ours, b["ids"], attention_mask=b["attn"], position_ids=b["pos"], start=P
        )
        diff = float(((old - hf_logprobs(hf, b)).abs() * b["resp"]).max())
    old = old * b["resp"]

    def step_ours(opt):
        opt.zero_grad(set_to_none=True)
        logp = token_logprobs(
            ours, b["ids"], attention_mask=b["attn"], position_ids=b["pos"], start=P
        )
        loss, _ = policy_loss(logp, old, b["adv"], b["resp"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    def step_fused(opt, chunk_size: int = FUSED_CHUNK_SIZE, model=fused):
        opt.zero_grad(set_to_none=True)
        spec = FusedLossSpec(anchor_logprobs=old, advantages=b["adv"], response_mask=b["resp"])
        out = fused_policy_loss(
            model,
            b["ids"],
            spec,
            attention_mask=b["attn"],
            position_ids=b["pos"],
            start=P,
            chunk_size=chunk_size,
        )
        out.loss.backward()
        opt.step()
        return float(out.loss.detach())

    def step_hf(opt):
        opt.zero_grad(set_to_none=True)
        loss = hf_ppo_loss(hf_logprobs(hf, b), old, b["adv"], b["resp"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=1e-5)
    opt_ac = torch.optim.AdamW(fused_ac.parameters(), lr=1e-5)

    def step_ac(opt):
        return step_fused(opt, model=fused_ac)

    l_ours, l_hf = step_ours(opt_ours), step_hf(opt_hf)  # warm-up; the first losses must agree
    l_fused, l_ac = step_fused(opt_fused), step_ac(opt_ac)
    t_ours, t_hf, t_fused, t_ac = [], [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        step_hf(opt_hf)
        t1 = time.perf_counter()
        step_ours(opt_ours)
        t2 = time.perf_counter()
        step_fused(opt_fused)
        t3 = time.perf_counter()
        step_ac(opt_ac)
        t4 = time.perf_counter()
        t_hf.append(t1 - t0)
        t_ours.append(t2 - t1)
        t_fused.append(t3 - t2)
        t_ac.append(t4 - t3)
    # peak bytes of the tensors forward + backward create (activations, logits, gradients; the
    # weights and AdamW states exist before), op by op, one untimed pass per side without the
    # optimizer step (AdamW's temporaries are the same on every side and would hide the rest)
    peak = {}
    for name, fn, opt in (
        ("hf", step_hf, opt_hf),
        ("ours", step_ours, opt_ours),
        ("fused", step_fused, opt_fused),
        ("fused_ac", step_ac, opt_ac),
    ):
        tracker = TensorMemoryTracker()
        with tracker:
            fn(_NoStep(opt))
        peak[name] = tracker.peak.get("cpu", 0) / 2**20
        opt.zero_grad(set_to_none=True)
    tracker = TensorMemoryTracker()
    with tracker:
        step_fused(_NoStep(opt_fused), chunk_size=DEFAULT_CHUNK_SIZE)
    peak["fused_default"] = tracker.peak.get("cpu", 0) / 2**20
    opt_fused.zero_grad(set_to_none=True)
    tokens = int(b["attn"].sum())
    ours_tps = tokens / statistics.median(t_ours)
    hf_tps = tokens / statistics.median(t_hf)
    fused_tps = tokens / statistics.median(t_fused)
    ac_tps = tokens / statistics.median(t_ac)
    print(
        f"Qwen3 {layers} layers, hidden {dim}, vocab {vocab}, fp32; batch {B} x (prompt <= {P} "
        f"| response <= {R}), {tokens} real tokens; AdamW; {threads} thread(s); median of {iters}"
    )
    print(
        f"agreement: max |logprob diff| {diff:.1e}; first-step loss ours {l_ours:.6f} vs "
        f"HF {l_hf:.6f}, fused {l_fused:.6f}, fused + activation checkpointing {l_ac:.6f}"
    )
    print(
        f"peak tensor memory of forward + backward (MiB): HF {peak['hf']:.1f}, ours {peak['ours']:.1f}, "
        f"fused {peak['fused']:.1f} (chunk_size {FUSED_CHUNK_SIZE}; "
        f"{peak['fused_default']:.1f} at the default {DEFAULT_CHUNK_SIZE}), fused + activation "
        f"checkpointing {peak['fused_ac']:.1f}"
    )
    return [
        ["PPO update tokens/s", f"{ours_tps:.0f}", f"{hf_tps:.0f}", ours_tps / hf_tps, "—"],
        [
            "PPO update tokens/s, fused loss",
            f"{fused_tps:.0f}",
            f"{hf_tps:.0f}",
            fused_tps / hf_tps,
            ">= 1",
        ],
        [
            "PPO fwd+bwd peak tensor MiB, fused loss",
            f"{peak['fused']:.1f}",
            f"{peak['hf']:.1f}",
            peak["fused"] / peak["hf"],
            "<= 0.33",
        ],
        [
            "PPO update tokens/s, fused loss + activation checkpointing",
            f"{ac_tps:.0f}",
            f"{hf_tps:.0f}",
            ac_tps / hf_tps,
            ">= 1",
        ],
        [
            "PPO fwd+bwd peak tensor MiB, fused loss + activation checkpointing",
            f"{peak['fused_ac']:.1f}",
            f"{peak['hf']:.1f}",
            peak["fused_ac"] / peak["hf"],
            "<= 0.33",
        ],
    ]


def compile_update(quick: bool) -> list[list]:
    """The fused-loss update with compiled decoder blocks vs eager, same weights and batch."""
    import dataclasses

    from minippo.models import (
        FusedLossSpec,
        Transformer,
        fused_policy_loss,
        init_weights,
        qwen3_tiny,
        token_logprobs,
    )
    from minippo.parallel import compile_blocks

    shape = dict(dim=64, n_layers=2) if quick else dict(dim=512, n_layers=6, n_heads=8)
    shape |= dict(n_kv_heads=4 if not quick else 2, head_dim=64 if not quick else 16)
    shape |= dict(intermediate_size=1536 if not quick else 128, vocab_size=51)
    args = dataclasses.replace(qwen3_tiny(), **shape)
    B, P, R = (4, 6, 16) if quick else (8, 6, 128)
    iters = 2 if quick else 6
    eager = init_weights(Transformer(args), seed=0)
    compiled = compile_blocks(copy.deepcopy(eager))
    b = ppo_batch(B, P, R, args.vocab_size)
    with torch.no_grad():
        old = token_logprobs(
            eager, b["ids"], attention_mask=b["attn"], position_ids=b["pos"], start=P
        )
    old = old * b["resp"]
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (eager, compiled)}

    def step(model) -> float:
        opts[model].zero_grad(set_to_none=True)
        spec = FusedLossSpec(anchor_logprobs=old, advantages=b["adv"], response_mask=b["resp"])
        out = fused_policy_loss(
            model, b["ids"], spec, attention_mask=b["attn"], position_ids=b["pos"], start=P
        )
        out.loss.backward()
        opts[model].step()
        return float(out.loss.detach())

    t0 = time.perf_counter()
    l_eager, l_comp = step(eager), step(compiled)  # the compiled side compiles here
    first_s = time.perf_counter() - t0
    step(compiled)  # a second call: no shape change, no recompile
    times = {eager: [], compiled: []}
    for _ in range(iters):
        for m in (eager, compiled):
            t = time.perf_counter()
            step(m)
            times[m].append(time.perf_counter() - t)
    tokens = int(b["attn"].sum())
    e_tps = tokens / statistics.median(times[eager])
    c_tps = tokens / statistics.median(times[compiled])
    print(
        f"Qwen3 {args.n_layers} layers, hidden {args.dim}, vocab {args.vocab_size}, fp32; batch "
        f"{B} x {P + R} tokens; fused loss, AdamW; median of {iters} interleaved pairs; first "
        f"steps (compile included) {first_s:.1f} s; first-step loss eager {l_eager:.6f}, "
        f"compiled {l_comp:.6f}"
    )
    return [
        [
            "PPO update tokens/s, compiled blocks vs eager",
            f"{c_tps:.0f}",
            f"{e_tps:.0f}",
            c_tps / e_tps,
            "—",
        ]
    ]


# ------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, seconds")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every measured side")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help="response length of the async/sync runs (sets rollout time ~ training time)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "perf")
    args = p.parse_args()
    if args.only is None:  # compiling takes tens of seconds: not part of the quick smoke run
        args.only = [s for s in SECTIONS if not (args.quick and s == "compile")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {machine()}")
    rows = []
    heads = ["figure", "ours", "baseline", "ratio", "goal"]
    for section in SECTIONS:
        if section not in args.only:
            continue
        print(f"\n## {section} (load average {load_average():.2f})")
        if section == "engine":
            got = engine_vs_hf(args.quick, args.threads)
        elif section == "async":
            new = 4 if args.quick else args.new_tokens
            got = async_vs_sync(args.quick, args.threads, new, args.out)
        elif section == "correction":
            got = correction_vs_copy(args.quick)
        elif section == "ppo":
            got = ppo_update(args.quick, args.threads)
        else:
            got = compile_update(args.quick)
        print(markdown_table(heads, got), flush=True)
        rows += got
    print(f"\n## summary (load average at the end {load_average():.2f})")
    print(markdown_table(heads, rows))


if __name__ == "__main__":
    main()
