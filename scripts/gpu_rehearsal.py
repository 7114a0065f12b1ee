"""Rehearsal of the SGLang backend's trainer side on one GPU, without SGLang installed.

For a GPU box where SGLang's kernels cannot be brought in (no internet): only the pinned sglang
wheel file is needed (39 MB; ``--sglang-wheel``, default the one tests/sglang_pieces.py caches),
from which SGLang's own ``MultiprocessingSerializer`` / ``SafeUnpickler`` (with its allow-list)
and its producer-side reduction patch are executed (torch only, nothing else of SGLang).

Checks, each recorded in the JSON written to ``--out`` (the script exits 1 if one fails):

1. ``agent_store``: under a 2-rank torchrun (gloo), each rank starts a child process the way
   SGLang starts its scheduler (multiprocessing spawn, inheriting the environment) inside
   ``minippo.engine.sglang_engine.engine_launch_environment()``; the child's
   ``init_process_group("gloo", init_method="tcp://127.0.0.1:<port>")`` must complete. The same
   child started without it is the control: with torch < 2.14.1 it times out (``hang_reproduced``).
2. ``publish`` per model shape (random Qwen3 of 0.6B and 1.7B shapes; ``--dry-run``: small ones):
   FSDP2-shard, gather bf16 buckets (``full_tensor_buckets``), check and cast them and serialise
   them exactly as the backend does (``prepare_bucket``, ``serialize_bucket``: SGLang's reduction
   patch on CUDA, so the handles carry the GPU's UUID), have a *spawned* process unpickle each
   payload with SGLang's SafeUnpickler and compare every tensor bit for bit (sha256 of the bytes);
   record allocated / reserved memory after each bucket and the peak, and the publish seconds per
   GiB (gather + cast + serialise + the consumer's rebuild; the digests are not timed).
3. ``torch_engine``: TorchEngine (bf16; CUDA, or CPU in the dry run) filled by a publish of the
   0.6B-shaped trainer, generating at T = 1: its logprobs against the trainer's (fp32,
   teacher-forced ``token_logprobs``), mean and max |Δ|.
4. ``ewma``: the EWMA correction's per-step update (``EWMA.after_optimizer_step``) and the snapshot
   swap (``ParamSwap.borrow``: save, load θ̄, restore) on fp32 local shards of Qwen3-4B over 8
   ranks (503 M parameters; ``--dry-run``: 1/1000 of that), median milliseconds and the implied
   bandwidth. Goal: EWMA < 10 ms on an H200 (about its memory-bandwidth limit).

Usage::

    python scripts/gpu_rehearsal.py --out rehearsal.json             # one CUDA GPU, < 8 minutes
    python scripts/gpu_rehearsal.py --dry-run --out /tmp/dry.json    # CPU, small shapes, gloo (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests/sglang_pieces.py loads SGLang's code from the wheel
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GIB = float(1 << 30)


# ----------------------------------------------------------------------------------------------
# 1. torchrun's agent store


def _scheduler_like(port: int, timeout_s: float, conn: Any) -> None:
    """What SGLang's scheduler does first: join its own one-rank group over tcp://."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=1,
            rank=0,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        dist.barrier()
        dist.destroy_process_group()
        conn.send({"ok": True, "seconds": time.perf_counter() - t0})
    except Exception as e:
        conn.send({"ok": False, "seconds": time.perf_counter() - t0, "error": str(e)[:300]})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_store_worker(out_dir: Path, child_timeout_s: float, control: bool) -> None:
    """One torchrun rank: a trainer-like group, then scheduler-like children (fixed, control)."""
    import multiprocessing

    import torch.distributed as dist

    from minippo.engine.sglang_engine import engine_launch_environment

    dist.init_process_group("gloo")  # env:// from torchrun, as the trainer
    rank = dist.get_rank()
    ctx = multiprocessing.get_context("spawn")  # what SGLang's Engine() forces
    runs: dict[str, Any] = {}
    modes = ("fixed", "control") if control else ("fixed",)
    for mode in modes:
        here, there = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_scheduler_like, args=(_free_port(), child_timeout_s, there))
        if mode == "fixed":
            with engine_launch_environment():
                proc.start()
        else:
            proc.start()
        runs[mode] = (proc, here)
    result: dict[str, Any] = {
        "rank": rank,
        "agent_store_env": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }
    for mode, (proc, here) in runs.items():
        got = here.recv() if here.poll(child_timeout_s + 60) else {"ok": False, "error": "hung"}
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        result[mode] = {**got, "exitcode": proc.exitcode}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def start_agent_store_check(child_timeout_s: float, control: bool, work: Path) -> Any:
    """Launch the 2-rank torchrun in the background (it runs while the other checks do)."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(Path(__file__).resolve()), "--agent-store-worker", str(work),
        "--child-timeout", str(child_timeout_s), *(["--control"] if control else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return SimpleNamespace(proc=proc, work=work, control=control, t0=time.perf_counter())


def finish_agent_store_check(run: Any) -> dict[str, Any]:
    try:
        _, stderr = run.proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        _, stderr = run.proc.communicate()
    proc, work, control, t0 = run.proc, run.work, run.control, run.t0
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)
             if (work / f"rank{r}.json").exists()]  # fmt: skip
    ok = proc.returncode == 0 and len(ranks) == 2 and all(r["fixed"]["ok"] for r in ranks)
    out = {
        "ok": ok,
        "torch": torch.__version__,
        "seconds": time.perf_counter() - t0,
        "ranks": ranks,
        "hang_reproduced": (
            all(not r["control"]["ok"] for r in ranks) if control and ranks else None
        ),
    }
    if not ok:
        out["stderr_tail"] = stderr[-2000:]
    return out


# ----------------------------------------------------------------------------------------------
# 2. publish: gather, serialise as the backend does, unpickle with SGLang's allow-list


def _random_init(model: torch.nn.Module, seed: int) -> None:
    """Random Qwen3 weights on the model's device (norms 1, the rest N(0, 0.02²))."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def build_sharded(args: Any, device: torch.device, seed: int) -> torch.nn.Module:
    from minippo.models import Transformer
    from minippo.parallel import shard_model

    with torch.device(device):
        model = Transformer(args)
    _random_init(model, seed)
    return shard_model(model)


def _memory(device: torch.device) -> dict[str, float | None]:
    if device.type != "cuda":
        return {"allocated_gib": None, "reserved_gib": None, "peak_gib": None}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


def check_publish(
    name: str, args: Any, device: torch.device, bucket_bytes: int, wheel: Path, here: Any
) -> tuple[dict[str, Any], torch.nn.Module]:
    """``here``: the pipe to the spawned consumer (``sglang_pieces.digest_server``)."""
    from minippo.engine._sglang_process import expected_hf_shapes
    from minippo.engine.sglang_engine import _cuda_ipc_collect, prepare_bucket, serialize_bucket
    from minippo.parallel import full_tensor_buckets
    from tests import sglang_pieces

    pieces = sglang_pieces.serialization_pieces(wheel)
    on_cuda = device.type == "cuda"
    # the backend's api namespace, with SGLang's own serializer; SGLang's reduction patch only
    # handles CUDA tensors (it breaks ForkingPickler for CPU ones), so the CPU dry run skips it
    api = SimpleNamespace(
        MultiprocessingSerializer=pieces.MultiprocessingSerializer,
        monkey_patch_torch_reductions=(
            pieces.monkey_patch_torch_reductions if on_cuda else (lambda: None)
        ),
    )
    t0 = time.perf_counter()
    model = build_sharded(args, device, seed=1)
    build_s = time.perf_counter() - t0
    expected = expected_hf_shapes(args)
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    buckets, seen, mismatches = [], set(), []
    total_bytes, timed_s = 0, 0.0
    start = time.perf_counter()
    it = iter(full_tensor_buckets(model, bucket_bytes=bucket_bytes, dtype=torch.bfloat16))
    for i in range(10**9):
        t_gather = time.perf_counter()
        bucket = next(it, None)
        if bucket is None:
            break
        named = prepare_bucket(
            bucket, i, expected=expected, seen=seen, device=device if on_cuda else None,
            dtype=torch.bfloat16, model_path=f"<{name}>",
        )  # fmt: skip
        payload = serialize_bucket(api, named)
        if on_cuda:
            torch.cuda.synchronize(device)
        produced_s = time.perf_counter() - t_gather
        here.send(payload)
        reply = here.recv()
        if "error" in reply:
            raise RuntimeError(f"the spawned consumer failed on bucket {i}: {reply['error']}")
        mine = sglang_pieces.tensor_digests(named)
        if reply["digests"] != mine:
            mismatches.append(i)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        total_bytes += nbytes
        timed_s += produced_s + reply["rebuild_s"]
        del bucket, named, payload
        _cuda_ipc_collect()  # as the backend: the consumer has dropped its handles
        buckets.append(
            {
                "index": i,
                "mib": nbytes / (1 << 20),
                "tensors": len(mine),
                "produce_s": produced_s,
                "rebuild_s": reply["rebuild_s"],
                **_memory(device),  # after the bucket's references are dropped
            }
        )
    _cuda_ipc_collect()
    report = {
        "ok": not mismatches and seen == set(expected),
        "model": name,
        "parameters": sum(math.prod(s) for s in expected.values()),
        "buckets": buckets,
        "bucket_mib": bucket_bytes / (1 << 20),
        "published_gib": total_bytes / GIB,
        "bit_exact": not mismatches,
        "mismatched_buckets": mismatches,
        "all_weights_published": seen == set(expected),
        "uuid_patch": "applied" if on_cuda else "not applicable on CPU (CUDA tensors only)",
        "consumer": "spawned process, SGLang's SafeUnpickler from the wheel",
        "publish_s_per_gib": timed_s / max(total_bytes / GIB, 1e-12),
        "wall_s": time.perf_counter() - start,
        "build_s": build_s,
        "peak": _memory(device),
    }
    return report, model


# ----------------------------------------------------------------------------------------------
# 3. TorchEngine vs the trainer


def check_torch_engine(model: torch.nn.Module, args: Any, device: torch.device) -> dict[str, Any]:
    from minippo.engine import GenerateRequest, SamplingParams, TorchEngine
    from minippo.models import token_logprobs
    from minippo.parallel import full_tensor_buckets
    from minippo.training.rollout_queue import collate_completions

    engine = TorchEngine(args, dtype="bfloat16", device=device, in_process=True)
    try:
        engine.publish_weights(
            full_tensor_buckets(model, bucket_bytes=256 << 20, dtype=engine.dtype), version=0
        )
        gen = torch.Generator().manual_seed(0)
        reqs = [
            GenerateRequest(
                torch.randint(1, args.vocab_size, (4 + 3 * i,), generator=gen).tolist(),
                SamplingParams(temperature=1.0, max_new_tokens=32, seed=100 + i),
                f"r{i}",
            )
            for i in range(8)
        ]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    batch = collate_completions(outs, list(range(len(outs))))
    with torch.no_grad():
        lp = token_logprobs(
            model,
            batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            temperature=1.0,
            start=batch.prompt_len,
        ).cpu()
    mask = batch.response_mask.bool()
    err = (lp[mask] - batch.rollout_logprobs[mask]).abs()
    return {
        "ok": bool(torch.isfinite(err).all()),
        "engine": f"TorchEngine bf16 on {device.type}",
        "trainer": "fp32 FSDP2, teacher-forced token_logprobs",
        "tokens": int(mask.sum()),
        "mean_abs_diff": float(err.mean()),
        "max_abs_diff": float(err.max()),
        "generate_s": gen_s,
    }


# ----------------------------------------------------------------------------------------------
# 4. EWMA update and snapshot swap on a 4B/8 shard


def _meta(args: Any) -> list[torch.nn.Parameter]:
    from minippo.models import Transformer

    with torch.device("meta"):
        return list(Transformer(args).parameters())


def shard_module(args: Any, ranks: int, scale: float, device: torch.device) -> torch.nn.Module:
    """fp32 local shards of ``args``'s parameters over ``ranks`` (FSDP2 splits dim 0, padded),
    every shard shrunk by ``scale`` along dim 0 (1.0: the real sizes)."""
    params = []
    for p in _meta(args):
        rows = max(1, math.ceil(math.ceil(p.shape[0] / ranks) * scale))
        params.append(torch.nn.Parameter(torch.randn(rows, *p.shape[1:], device=device)))
    module = torch.nn.Module()
    module.shards = torch.nn.ParameterList(params)
    return module


def _timed(fn: Any, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out[1:]


def check_ewma(device: torch.device, scale: float, repeats: int) -> dict[str, Any]:
    from minippo.models import qwen3_4b
    from minippo.parallel.weight_swap import ParamSwap, local_shards, nbytes
    from minippo.rl.correction import EWMA

    module = shard_module(qwen3_4b(), ranks=8, scale=scale, device=device)
    shards = local_shards(module)
    n_bytes = nbytes(shards)
    ewma = EWMA(max_staleness=2)
    ewma.on_weights_published(0, module)  # θ̄ ← θ
    update_ms = _timed(lambda: ewma.after_optimizer_step(module), device, repeats)
    swap = ParamSwap()
    theta_bar = ewma.theta_bar

    def swap_in_and_out() -> None:
        with swap.borrow(module) as load:
            load(theta_bar)

    swap_ms = _timed(swap_in_and_out, device, repeats)
    update, swapped = statistics.median(update_ms), statistics.median(swap_ms)
    full = sum(math.ceil(p.shape[0] / 8) * math.prod(p.shape[1:]) for p in _meta(qwen3_4b()))
    return {
        "ok": math.isfinite(update) and math.isfinite(swapped),
        "shard": f"Qwen3-4B / 8 ranks, fp32, scale {scale:g}",
        "parameters": sum(t.numel() for t in shards),
        "parameters_at_scale_1": full,
        "shard_gib": n_bytes / GIB,
        "ewma_update_ms": update,
        "ewma_update_gib_per_s": 3 * n_bytes / GIB / (update / 1e3),  # read θ̄, θ; write θ̄
        "snapshot_swap_ms": swapped,
        "snapshot_swap_gib_per_s": 6 * n_bytes / GIB / (swapped / 1e3),  # 3 copies, r + w
        "goal_ewma_ms": 10.0,
        "repeats": repeats,
    }


# ----------------------------------------------------------------------------------------------


def _shapes(dry_run: bool) -> dict[str, Any]:
    from minippo.models import ModelArgs, qwen3_0_6b, qwen3_1_7b

    if not dry_run:
        return {"qwen3_0_6b": qwen3_0_6b(), "qwen3_1_7b": qwen3_1_7b()}

    def small(dim: int, hidden: int) -> ModelArgs:  # Qwen3's layout at toy sizes
        return ModelArgs(
            vocab_size=512, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
            intermediate_size=hidden, max_seq_len=256, tie_word_embeddings=True,
        )  # fmt: skip

    return {"qwen3_0_6b_dry": small(128, 384), "qwen3_1_7b_dry": small(256, 768)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=False, help="where to write the JSON figures")
    p.add_argument("--dry-run", action="store_true", help="CPU, small shapes, gloo (for CI)")
    p.add_argument("--sglang-wheel", type=Path, default=None, help="the pinned sglang wheel")
    p.add_argument("--bucket-mib", type=int, default=None, help="publish bucket size")
    p.add_argument("--no-control", action="store_true", help="skip the agent-store control run")
    p.add_argument("--agent-store-worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=20.0, help=argparse.SUPPRESS)
    p.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.agent_store_worker is not None:
        agent_store_worker(a.agent_store_worker, a.child_timeout, a.control)
        return 0
    if a.out is None:
        p.error("--out is required")

    import multiprocessing

    import torch.distributed as dist

    from tests import sglang_pieces

    wheel = a.sglang_wheel or sglang_pieces.find_wheel()
    if wheel is None or not Path(wheel).exists():
        p.error(
            "no sglang wheel: pass --sglang-wheel PATH (pip download --no-deps sglang==0.5.23 "
            "elsewhere and copy it), or run the compat tests once to cache it"
        )
    if a.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        p.error("no CUDA GPU: run with --dry-run on CPU")
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "dry_run": a.dry_run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sglang_wheel": Path(wheel).name,
    }
    work = a.out.parent / (a.out.stem + "_work")
    agent_store = start_agent_store_check(
        child_timeout_s=2.0 if a.dry_run else 20.0, control=not a.no_control, work=work
    )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        world_size=1,
        rank=0,
    )
    bucket_bytes = (a.bucket_mib or (1 if a.dry_run else 512)) << 20
    report["publish"] = {}
    trainer = None
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    consumer = ctx.Process(target=sglang_pieces.digest_server, args=(str(wheel), there))
    consumer.start()  # the engine's scheduler stands for this process: spawned, SafeUnpickler
    try:
        for i, (name, args) in enumerate(_shapes(a.dry_run).items()):
            report["publish"][name], model = check_publish(
                name, args, device, bucket_bytes, wheel, here
            )
            if i == 0:
                trainer = (model, args)
            else:
                del model
        here.send(None)
        consumer.join(60)
        assert trainer is not None
        report["torch_engine"] = check_torch_engine(trainer[0], trainer[1], device)
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["ewma"] = check_ewma(device, scale=1e-3 if a.dry_run else 1.0, repeats=10)
    finally:
        dist.destroy_process_group()
        report["agent_store"] = finish_agent_store_check(agent_store)
    report["wall_s"] = time.perf_counter() - t_start
    checks = [report["agent_store"], *report["publish"].values()]
    checks += [report.get("torch_engine", {"ok": False}), report.get("ewma", {"ok": False})]
    report["ok"] = all(c["ok"] for c in checks)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "publish"}, indent=1)[:4000])
    for name, r in report["publish"].items():
        print(
            f"publish {name}: bit_exact={r['bit_exact']} {r['published_gib']:.3f} GiB in "
            f"{len(r['buckets'])} buckets, {r['publish_s_per_gib']:.2f} s/GiB, peak {r['peak']}"
        )
    print(f"rehearsal {'OK' if report['ok'] else 'FAILED'} in {report['wall_s']:.1f} s -> {a.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
