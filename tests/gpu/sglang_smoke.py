"""SGLang backend smoke check on real GPUs: one engine per rank, FSDP2 publish, logprobs, sleep/wake.

Run under torchrun (each rank drives the engine on its own GPU), for example::

    torchrun --nproc-per-node 2 tests/gpu/sglang_smoke.py
    torchrun --nproc-per-node 8 tests/gpu/sglang_smoke.py --model-path /models/Qwen3-0.6B

Without ``--model-path`` it builds a small random Qwen3 (config.json only: the engine starts with
``load_format="dummy"`` and every weight comes from the trainer's publish). With it, the trainer
loads that HF checkpoint and the engine still starts from dummy weights.

Steps, on every rank, each asserted:
    1. engine up (tp=1 on GPU local_rank, ports by rank); generate refuses before any publish;
    2. publish version 0 from the FSDP2-sharded trainer (full_tensor_buckets, bf16 buckets);
    3. generate with logprobs at T = 1.0, 0.7 and greedy; every token stamped version 0;
    4. logprob agreement: engine vs the trainer's teacher-forced ``token_logprobs`` on the same
       tokens: mean |Δ| <= MEAN_TOL and max |Δ| <= MAX_TOL (bf16 engine vs fp32 trainer);
    5. partial rollout: a long request, pause, publish version 1 (perturbed weights), resume;
       its versions are 0...0 1...1 and each part agrees with the trainer's weights of that version;
    6. sleep / wake (memory_mode="sleep"): sleep frees GPU memory, wake + publish version 2, then
       generation carries version 2 and agrees with the trainer;
    7. abort returns the partial completion; shutdown.
Prints one summary line per rank; exits non-zero on the first failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

# extra ServerArgs passed by this check (tests/unit/test_sglang_api_compat.py checks the names)
SMOKE_EXTRA_SERVER_ARGS = {"cuda_graph_max_bs_decode": 16}
MEAN_TOL = 0.02  # mean |engine - trainer| logprob, bf16 engine vs fp32 trainer
MAX_TOL = 0.5  # max over all tokens (a few tokens near ties move more in bf16)


def _tiny_config() -> dict:
    from minippo.models import ModelArgs
    from minippo.models.hf_checkpoint import hf_config_from_model_args

    args = ModelArgs(
        vocab_size=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64,
        intermediate_size=1024, rope_theta=10_000.0, max_seq_len=2048, tie_word_embeddings=True,
    )  # fmt: skip
    return hf_config_from_model_args(args, dtype=torch.bfloat16)


def _logprob_errors(model, completions, temperature: float) -> list[float]:
    from minippo.models import token_logprobs
    from minippo.training.rollout_queue import collate_completions

    batch = collate_completions(completions, list(range(len(completions))))
    dev = next(model.parameters()).device
    with torch.no_grad():
        lp = token_logprobs(
            model,
            batch.input_ids.to(dev),
            attention_mask=batch.attention_mask.to(dev),
            position_ids=batch.position_ids.to(dev),
            temperature=temperature or 1.0,
            start=batch.prompt_len,
        ).cpu()
    m = batch.response_mask.bool()
    return (lp[m] - batch.rollout_logprobs[m]).abs().tolist()


def _check_agreement(errors: list[float], what: str) -> str:
    mean, worst = statistics.fmean(errors), max(errors)
    assert mean <= MEAN_TOL and worst <= MAX_TOL, (
        f"{what}: mean |Δ| {mean:.4f} (tol {MEAN_TOL}), max |Δ| {worst:.4f} (tol {MAX_TOL})"
    )
    return f"{what} mean|Δ|={mean:.2e} max|Δ|={worst:.2e}"


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _joined(t: threading.Thread, box: dict, timeout: float = 600.0):
    t.join(timeout)
    assert not t.is_alive(), f"generate did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF checkpoint (default: tiny random Qwen3)")
    p.add_argument("--workdir", default="/tmp/minippo_sglang_smoke")
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--base-port", type=int, default=31000)
    p.add_argument("--bucket-mb", type=int, default=64)
    a = p.parse_args()

    from minippo.engine import GenerateRequest, SamplingParams
    from minippo.engine.sglang_engine import SGLangEngine
    from minippo.models import Transformer, from_pretrained, init_weights, model_args_from_hf_config
    from minippo.parallel import full_tensor_buckets, init_distributed, shard_model

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    info = init_distributed()
    assert info.device.type == "cuda", "the smoke check needs CUDA"
    log: list[str] = []

    # the engine first: its shutdown() kills every child process of this process
    model_path = a.model_path
    if model_path is None:
        model_path = str(Path(a.workdir) / "tiny-qwen3")
        if info.rank == 0:
            Path(model_path).mkdir(parents=True, exist_ok=True)
            (Path(model_path) / "config.json").write_text(json.dumps(_tiny_config()))
        dist.barrier()
    with open(Path(model_path) / "config.json") as f:
        args = model_args_from_hf_config(json.load(f))
    t0 = time.perf_counter()
    engine = SGLangEngine(  # as the recipe builds it: the config node plus model_args
        model_path,
        model_args=args,
        mem_fraction_static=a.mem_fraction,
        memory_mode="sleep",
        dtype="bfloat16",
        base_port=a.base_port,
        sampling_backend="pytorch",
        extra_server_args=SMOKE_EXTRA_SERVER_ARGS,
    )
    log.append(f"engine up {time.perf_counter() - t0:.1f}s")
    try:
        r0 = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0), "early")
        try:
            engine.generate([r0])
            raise AssertionError("generate before the first publish must raise")
        except RuntimeError:
            pass

        # 2. trainer: FSDP2 (fp32 master weights), publish version 0
        if a.model_path is None:
            model = init_weights(Transformer(args), seed=0, std=0.02)
        else:
            model = from_pretrained(a.model_path, dtype=torch.float32, device="cpu")
        model = shard_model(model.to(info.device))
        bucket_bytes = a.bucket_mb << 20
        t0 = time.perf_counter()
        engine.publish_weights(
            full_tensor_buckets(model, bucket_bytes=bucket_bytes, dtype=engine.dtype), version=0
        )
        log.append(f"publish {time.perf_counter() - t0:.2f}s")

        # 3-4. generation with logprobs, agreement with the trainer
        g = torch.Generator().manual_seed(info.rank)
        for temperature in (1.0, 0.7, 0.0):
            reqs = [
                GenerateRequest(
                    torch.randint(1, args.vocab_size, (5 + 3 * i,), generator=g).tolist(),
                    SamplingParams(temperature=temperature, max_new_tokens=64, seed=100 + i),
                    f"t{temperature}-{i}",
                )
                for i in range(8)
            ]
            outs = engine.generate(reqs)
            assert all(c.versions == [0] * len(c.token_ids) for c in outs)
            assert all(c.finish_reason == "length" for c in outs)
            log.append(
                _check_agreement(_logprob_errors(model, outs, temperature), f"T={temperature}")
            )

        # 5. partial rollout across a publish
        saved = [p.detach().clone() for p in model.parameters()]
        long = GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=2000, seed=5), "long")
        t, box = _in_thread(lambda: engine.generate([long]))
        time.sleep(0.2)
        engine.pause()
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(torch.randn_like(prm) * 0.01)
        engine.publish_weights(
            full_tensor_buckets(model, bucket_bytes=bucket_bytes, dtype=engine.dtype), version=1
        )
        engine.resume()
        (c,) = _joined(t, box)
        n_old = c.versions.count(0)
        assert c.versions == [0] * n_old + [1] * (len(c.versions) - n_old), "versions not split"
        assert 0 < n_old < len(c.versions), f"the publish did not land mid-response ({n_old})"
        new_err = _logprob_errors(model, [c], 1.0)[n_old:]
        with torch.no_grad():
            new_params = [prm.detach().clone() for prm in model.parameters()]
            for prm, old in zip(model.parameters(), saved):
                prm.copy_(old)
        old_err = _logprob_errors(model, [c], 1.0)[:n_old]
        with torch.no_grad():
            for prm, new in zip(model.parameters(), new_params):
                prm.copy_(new)
        log.append(
            _check_agreement(old_err + new_err, f"partial({n_old}|{len(c.versions) - n_old})")
        )

        # 6. sleep / wake
        free_awake = torch.cuda.mem_get_info(info.device)[0]
        engine.sleep()
        free_asleep = torch.cuda.mem_get_info(info.device)[0]
        assert free_asleep > free_awake + (64 << 20), (free_awake, free_asleep)
        engine.wake()
        engine.publish_weights(
            full_tensor_buckets(model, bucket_bytes=bucket_bytes, dtype=engine.dtype), version=2
        )
        outs = engine.generate(
            [
                GenerateRequest([4, 5, 6], SamplingParams(max_new_tokens=32, seed=i), f"w{i}")
                for i in range(4)
            ]
        )
        assert all(c.versions == [2] * 32 for c in outs)
        log.append(f"sleep freed {(free_asleep - free_awake) / 2**30:.2f} GiB")
        log.append(_check_agreement(_logprob_errors(model, outs, 1.0), "after wake"))

        # 7. abort
        ab = GenerateRequest([1], SamplingParams(max_new_tokens=2000, seed=1), "ab")
        t, box = _in_thread(lambda: engine.generate([ab]))
        time.sleep(0.2)
        partials = engine.abort()
        (c,) = _joined(t, box)
        if partials:
            (partial,) = partials
            assert partial.finish_reason == "abort" and c.token_ids == partial.token_ids
            log.append(f"abort kept {len(partial.token_ids)} tokens")
        else:  # the request finished before the abort arrived
            assert c.finish_reason == "length"
            log.append("abort: request had finished")
    finally:
        engine.shutdown()
    dist.barrier()
    print(f"[rank {info.rank}] OK  " + " | ".join(log), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
