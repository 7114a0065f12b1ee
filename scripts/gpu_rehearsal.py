"""The GPU rehearsal: does minippo's GPU path work on this machine, and does the memory plan hold?

One command on one CUDA GPU (no internet needed; docs/sglang_backend.md "Verify on hardware"),
one JSON (``--out``) and a one-screen summary; exit 0 if every check that ran passed, 1 if one
failed, 3 if one did not start within the budget. ``--dry-run`` runs the same code on CPU with
tiny shapes and gloo (hiding any GPU), and writes the same JSON keys (default-suite tests run
it, so the rehearsal cannot rot; its ``tiny`` check in the slow suite).

The checks (``--only`` / ``--skip`` choose; ``tiny`` and ``recipe`` matter most). They run in the
order tiny, recipe, publish, torch_engine, ewma: the GPU runs in their own processes first, while
this process has not touched the GPU; ``agent_store`` and the recipe's plan run in the background.

``recipe``
    The real recipe (recipes/async_ppo.py's ``recipe_main``) on
    ``configs/qwen3_0_6b_synthetic_1gpu.yaml``: one rank under torchrun (NCCL), bf16 FSDP2 over fp32
    master weights, activation checkpointing, ``rollout.mode=alternate`` with TorchEngine in bf16
    on the same GPU in its own process, ``rollout.offload_trainer=true``, a random Qwen3 of 0.6B
    shape with the real vocabulary (151,936) on a toy task (TinyTokenizer padded to that
    vocabulary; see the config's header). The recipe runs unchanged; the rehearsal observes it
    from outside by wrapping the methods it calls (``PhaseProbe``). Per step: generation /
    offload / no-grad passes / PPO updates / publish / checkpoint seconds; the trainer's peak
    allocated and reserved bytes in the generation phase (engine awake) and the training phase
    (engine asleep); the engine process's own peaks, and what it still holds after ``sleep``;
    the bytes outside both allocators (CUDA contexts, NCCL); bytes published and GB/s; tokens
    per second. Next to them: ``minippo plan``'s two phases for the same config (formulas for
    generation, the fake-tensor step for training; computed in the background). Fails unless the
    run exits 0 with every step logged, finite losses and the expected backend (NCCL; gloo in
    the dry run), and on the GPU unless ``sleep`` left the engine process at most
    SLEEP_LEFTOVER_BYTES, every ``offload`` freed at least the bytes it moved and the engine's
    peak covered its weights (``recipe_checks``). Whether the plan holds is reported beside it
    (``plan_check``: measured / planned bytes per phase), not a failure.
``tiny``
    tiny_cpu through the CLI, on CUDA: as shipped (a plain process: the trainer on the GPU,
    TorchEngine on CPU cores, ``rollout.mode=overlap``), and on the GPU path (``minippo run
    --nproc-per-node 1``: NCCL, alternate, TorchEngine on the GPU, trainer offload). Each must
    learn: mean reward of the last 5 steps >= 0.8 (the 60-step run reaches 0.99 on CPU,
    configs/tiny_cpu.yaml). The dry run takes 3 steps and does not judge learning.
``publish``
    Needs the pinned sglang wheel *file* (``--sglang-wheel``; 39 MB, none of its kernels): per
    model shape (random Qwen3 of 0.6B and 1.7B shapes), FSDP2-shard, gather bf16 buckets, check,
    cast and serialise them exactly as the SGLang backend does (``prepare_bucket``,
    ``serialize_bucket``: SGLang's reduction patch on CUDA), unpickle each payload in a spawned
    process with SGLang's own SafeUnpickler and compare every tensor bit for bit; publish
    seconds per GiB and the memory after each bucket.
``torch_engine``
    TorchEngine (bf16) filled by a publish of the 0.6B-shaped trainer, generating at T = 1: its
    logprobs against the trainer's (fp32, teacher-forced), mean and max |Δ|.
``ewma``
    The EWMA correction's per-step update and the snapshot swap on fp32 shards of Qwen3-4B over
    8 ranks (503 M parameters; the dry run: 1/1000), median ms and GiB/s; goal < 10 ms.
``agent_store``
    Under a 2-rank torchrun (gloo), each rank starts a child the way SGLang starts its scheduler,
    inside ``engine_launch_environment()``; the child's own ``init_process_group`` must complete
    (the control without it hangs with torch < 2.14.1). CPU only; runs in the background.

Time on one H200 (not measured yet; an estimate from the work each check does, see
docs/sglang_backend.md): about 4 minutes for everything, within ``--budget-s`` (default 450 s):
a check that would start after the budget is recorded as not run, and the JSON is rewritten after
every check, so a run cut short still leaves what it measured.

Usage::

    python scripts/gpu_rehearsal.py --out rehearsal.json --sglang-wheel sglang-0.5.23-*.whl
    python scripts/gpu_rehearsal.py --out rehearsal.json --skip publish      # without the wheel
    python scripts/gpu_rehearsal.py --dry-run --out /tmp/dry.json             # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# minippo from this checkout; tests/sglang_pieces.py for SGLang's code
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GIB = float(1 << 30)
MIB = 1 << 20
CHECKS = ("recipe", "tiny", "publish", "torch_engine", "ewma", "agent_store")
RECIPE_CONFIG = ROOT / "configs" / "qwen3_0_6b_synthetic_1gpu.yaml"
# The dry run: the same config at toy sizes, the engine on CPU cores (gloo, CPU kernels).
RECIPE_DRY_OVERRIDES = [
    "model={_component_: minippo.models.qwen3_tiny, vocab_size: 1024}",
    "tokenizer.vocab_size=1024",  # still padded: 973 reserved ids, as the real run's 151,885
    "engine.device=cpu",
    "rollout.groups_per_batch=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "ppo.micro_batch_size=2",
    "ppo.score_micro_batch_size=8",
]
RECIPE_STEPS, DRY_STEPS = 4, 3
TINY_STEPS = 60  # tiny_cpu as shipped
# mean reward of the last 5 steps (tests/recipes: test_tiny_cpu_default_learns)
TINY_THRESHOLD = 0.8
# The memory TorchEngine may still hold after sleep(): PyTorch keeps cuBLAS's workspace (32 MiB
# per handle and stream on Hopper, shared with cuBLASLt) in its allocator for the process's
# life, which empty_cache() cannot release; two such workspaces. The weights alone are 1.1 GiB.
SLEEP_LEFTOVER_BYTES = 64 * MIB
COMPILE_CACHE = 8  # Dynamo's recompile limit: graphs one compiled function may hold
# the tensor fields of the policy loss's spec (minippo.models.FusedLossSpec)
LOSS_INPUTS = ("anchor_logprobs", "advantages", "response_mask", "weights", "keep_mask",
               "global_tokens", "global_seqs", "ref_logprobs")  # fmt: skip
DEFAULT_BUDGET_S = 450.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """The environment of a child run: this checkout importable, no inherited torchrun rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    parts = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def _run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> SimpleNamespace:
    """Run ``cmd``; returncode 124 and the output so far when it outlives ``timeout_s``."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=timeout_s
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code = 124
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        err += f"\n(killed after {timeout_s:.0f} s)"
    return SimpleNamespace(
        returncode=code, stdout=out, stderr=err, seconds=time.perf_counter() - t0
    )


def _torchrun(nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
    ]  # fmt: skip


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _max(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _sum(*values: Any) -> Any:
    return None if any(v is None for v in values) else sum(values)


def _ratio(a: Any, b: Any) -> float | None:
    return None if a is None or not b else a / b


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# ----------------------------------------------------------------------------------------------
# The recipe: PhaseProbe, the torchrun worker, the plan worker, the check


def _step_skeleton(step: int) -> dict[str, Any]:
    """Every key of one step's record (None until measured; CUDA figures stay None on CPU)."""
    return {
        "step": step,
        "offload_bytes": None,  # what TrainerOffload moved to the host (its nbytes)
        "offload_freed_bytes": None,  # the trainer's allocated bytes that offload() freed
        "generation": {
            "trainer_peak_allocated": None,
            "trainer_peak_reserved": None,
            "engine_peak_allocated": None,  # the engine process, since its wake
            "engine_peak_reserved": None,
            "device_used_before_sleep": None,  # whole GPU (cudaMemGetInfo)
            "non_allocator_bytes": None,  # device used - both processes' reserved bytes
            "engine_allocated_after_sleep": None,
            "engine_reserved_after_sleep": None,
            "device_used_after_sleep": None,
        },
        "training": {
            "trainer_peak_allocated": None,  # from get_batch's return (reload, no-grad passes,
            "trainer_peak_reserved": None,  # PPO updates) to the publish
            "device_used_at_end": None,
        },
        "publish": {
            "bytes": None,
            "wake_s": None,  # the engine's wake (TorchEngine: its weights back to the GPU)
            "push_s": None,  # publish_weights returned (buckets gathered, cast and sent)
            "applied_s": None,  # the engine has applied them (wait_published)
            "gb_per_s": None,  # bytes / (applied_s - wake_s), 1e9 bytes
            "trainer_peak_allocated": None,
            "trainer_peak_reserved": None,
            # the trainer's allocator as the engine wakes (after the recipe's empty_cache()):
            # reserved - allocated is what it keeps cached from the engine
            "trainer_allocated_at_wake": None,
            "trainer_reserved_at_wake": None,
        },
        "checkpoint_s": None,
    }


class PhaseProbe:
    """Watches the real recipe from outside: wrappers around the methods its train loop calls
    (``RolloutQueue.get_batch`` / ``publish``, ``TrainerOffload.offload``, ``TorchEngine``'s
    ``sleep`` / ``wake``, the recipe's ``save_checkpoint``) record each phase's seconds and, on
    CUDA, the trainer's allocator peaks (reset at each phase boundary), the engine process's
    figures (``TorchEngine.stats()``) and the whole device's used bytes. It changes nothing the
    recipe computes; it only waits for each publish to be applied (to time it), which the recipe
    alone would overlap with the correction's snapshot."""

    def __init__(self, device: torch.device, sync_every: int = 1) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.sync_every = sync_every
        self.records: dict[int, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}
        self._patches: list[tuple[Any, str, Any]] = []
        self._step = -1  # the step whose batch is being generated (-1: setup)
        self._publish_step = -1  # the step whose publish runs (-1: setup's)
        self._wake_s = 0.0
        # the policy loss's inputs as the recipe built them and as the loss received them inside
        # the model's forward (FSDP2 mixed precision must not cast them): per field, the dtypes
        # of the first pass and the number of passes in which dtype or value changed
        self.loss_inputs: dict[str, dict[str, Any]] = {}
        self._built_spec: Any = None

    # -- measurements ---------------------------------------------------------------------------
    def _reset_peaks(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peaks(self) -> dict[str, int | None]:
        if not self.cuda:
            return {"trainer_peak_allocated": None, "trainer_peak_reserved": None}
        torch.cuda.synchronize(self.device)
        return {
            "trainer_peak_allocated": torch.cuda.max_memory_allocated(self.device),
            "trainer_peak_reserved": torch.cuda.max_memory_reserved(self.device),
        }

    def _allocated(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _device_used(self) -> int | None:
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def record(self, step: int) -> dict[str, Any]:
        return self.records.setdefault(step, _step_skeleton(step))

    # -- wrappers -------------------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, functools.wraps(original)(make(original)))
        self._patches.append((owner, name, original))

    def install(self, recipe_cls: type) -> PhaseProbe:
        """Wrap the methods (class attributes: every instance the recipe builds sees them)."""
        from minippo.engine.torch_engine import TorchEngine
        from minippo.parallel import TrainerOffload
        from minippo.training.rollout_queue import RolloutQueue

        probe = self

        def get_batch(original):
            def wrapped(queue, step, timeout=None):
                probe._step = step
                if "backend" not in probe.info:
                    import torch.distributed as dist

                    probe.info["backend"] = dist.get_backend() if dist.is_initialized() else None
                probe._reset_peaks()  # generation: after offload(), until the engine sleeps
                out = original(queue, step, timeout)
                probe.record(step)["generation"].update(probe._peaks())
                probe._reset_peaks()  # training: reload, no-grad passes, PPO updates
                return out

            return wrapped

        def offload(original):
            def wrapped(self_):
                before = probe._allocated()
                seconds = original(self_)
                rec = probe.record(probe._step + 1)  # offload() runs before get_batch(step)
                rec["offload_bytes"] = self_.nbytes
                after = probe._allocated()
                rec["offload_freed_bytes"] = None if before is None else before - after
                return seconds

            return wrapped

        def sleep(original):
            def wrapped(engine):
                gen = probe.record(probe._step)["generation"]
                stats = engine.stats()  # the engine process's figures, awake
                used = probe._device_used()
                gen["engine_peak_allocated"] = stats.get("cuda_peak_allocated_bytes")
                gen["engine_peak_reserved"] = stats.get("cuda_peak_reserved_bytes")
                gen["device_used_before_sleep"] = used
                if used is not None and stats.get("cuda_reserved_bytes") is not None:
                    mine = torch.cuda.memory_reserved(probe.device)
                    gen["non_allocator_bytes"] = used - mine - stats["cuda_reserved_bytes"]
                original(engine)
                after = engine.stats()
                gen["engine_allocated_after_sleep"] = after.get("cuda_allocated_bytes")
                gen["engine_reserved_after_sleep"] = after.get("cuda_reserved_bytes")
                gen["device_used_after_sleep"] = probe._device_used()

            return wrapped

        def wake(original):
            def wrapped(engine):
                if probe.cuda:  # the step whose publish wakes it: the probe's current one
                    rec = probe.record(probe._publish_step)["publish"]
                    rec["trainer_allocated_at_wake"] = probe._allocated()
                    rec["trainer_reserved_at_wake"] = torch.cuda.memory_reserved(probe.device)
                t0 = time.perf_counter()
                original(engine)
                probe._wake_s = time.perf_counter() - t0

            return wrapped

        def publish(original):
            def wrapped(queue, buckets, version):
                step = version * probe.sync_every - 1  # published at the end of this step
                probe._publish_step = step
                rec = probe.record(step)
                if step >= 0:
                    rec["training"].update(probe._peaks())
                    rec["training"]["device_used_at_end"] = probe._device_used()
                probe._reset_peaks()
                sent = [0]

                def counted():
                    for bucket in buckets:
                        sent[0] += sum(t.numel() * t.element_size() for _, t in bucket)
                        yield bucket

                probe._wake_s = 0.0
                t0 = time.perf_counter()
                original(queue, counted(), version)
                pushed = time.perf_counter() - t0
                queue.engine.wait_published()
                applied = time.perf_counter() - t0
                moved = applied - probe._wake_s
                rec["publish"].update(
                    bytes=sent[0],
                    wake_s=probe._wake_s,
                    push_s=pushed,
                    applied_s=applied,
                    gb_per_s=sent[0] / 1e9 / moved if moved > 0 else None,
                    **probe._peaks(),
                )

            return wrapped

        def save_checkpoint(original):
            def wrapped(recipe, step):
                t0 = time.perf_counter()
                original(recipe, step)
                probe.record(step - 1)["checkpoint_s"] = time.perf_counter() - t0

            return wrapped

        def fused_policy_loss(original):  # the recipe's call: the spec it built
            def wrapped(*args, **kwargs):
                probe._built_spec = args[2]
                return original(*args, **kwargs)

            return wrapped

        def from_hidden(original):  # inside the model's forward: the spec the loss reads
            def wrapped(hidden, weight, targets, spec, **kwargs):
                probe.compare_loss_inputs(probe._built_spec, spec)
                return original(hidden, weight, targets, spec, **kwargs)

            return wrapped

        import minippo.models as models
        import minippo.models.model as model_module

        self._wrap(models, "fused_policy_loss", fused_policy_loss)
        self._wrap(model_module, "fused_policy_loss_from_hidden", from_hidden)
        self._wrap(RolloutQueue, "get_batch", get_batch)
        self._wrap(RolloutQueue, "publish", publish)
        self._wrap(TrainerOffload, "offload", offload)
        self._wrap(TorchEngine, "sleep", sleep)
        self._wrap(TorchEngine, "wake", wake)
        self._wrap(recipe_cls, "save_checkpoint", save_checkpoint)
        return self

    def compare_loss_inputs(self, built: Any, inside: Any) -> None:
        """Record each tensor field of the policy loss's spec: its dtype as built and as read
        inside forward, and whether the two differ in dtype or value."""
        if built is None:
            return
        for name in LOSS_INPUTS:
            b, i = getattr(built, name), getattr(inside, name)
            if not torch.is_tensor(b):
                continue
            entry = self.loss_inputs.setdefault(
                name, {"built": str(b.dtype), "in_forward": str(i.dtype), "changed_passes": 0}
            )
            changed = i.dtype != b.dtype or not torch.equal(i.to(b.dtype), b)
            entry["changed_passes"] += int(changed)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def _nccl_bytes(original: Any, probe: PhaseProbe) -> Any:
    """``init_distributed`` wrapped: on CUDA, the device bytes the process group takes beyond
    this process's allocator (NCCL's communicator buffers; the process's CUDA context exists
    already), measured after a first collective."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not probe.cuda:
            return original(*args, **kwargs)
        free, total = torch.cuda.mem_get_info(probe.device)
        before = total - free - torch.cuda.memory_reserved(probe.device)
        out = original(*args, **kwargs)
        import torch.distributed as dist

        dist.barrier()
        torch.cuda.synchronize(probe.device)
        free, total = torch.cuda.mem_get_info(probe.device)
        probe.info["nccl_bytes"] = total - free - torch.cuda.memory_reserved(probe.device) - before
        return out

    return wrapped


def recipe_worker(spec_path: Path) -> None:
    """One torchrun rank: load the config, run the recipe's own ``recipe_main`` with the probe
    installed, write the probe's records (rank 0) to the spec's ``out``."""
    import runpy

    from minippo.config import load_config
    from minippo.config._report import report_error, setup_logging

    spec = json.loads(spec_path.read_text())
    setup_logging()
    cuda = torch.cuda.is_available() and not spec["dry_run"]
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    namespace = runpy.run_path(str(ROOT / "recipes" / "async_ppo.py"))
    cfg = load_config(spec["config"], spec["overrides"])
    from minippo.training.preflight import setting

    probe = PhaseProbe(device or torch.device("cpu"), int(setting(cfg, "rollout.sync_every")))
    probe.info.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        gpu_total_bytes=torch.cuda.mem_get_info(device)[1] if cuda else None,
        # the engine's publishes go through shared memory: a small /dev/shm fails them
        shm_total_bytes=shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else None,
    )
    probe.install(namespace["AsyncPPORecipe"])
    import minippo.parallel as parallel

    compiled_before = parallel.compilation_count()

    probe._wrap(parallel, "init_distributed", functools.partial(_nccl_bytes, probe=probe))
    code = 0
    t0 = time.perf_counter()
    try:
        namespace["recipe_main"](cfg)
    except (Exception, KeyboardInterrupt) as e:
        code = report_error(e)
    finally:
        probe.uninstall()
    probe.info["recipe_s"] = time.perf_counter() - t0
    after = parallel.compilation_count()  # what the run compiled (torch.compile, this process)
    probe.info["compilations"] = {k: after[k] - compiled_before[k] for k in after}
    if int(os.environ.get("RANK", "0")) == 0:
        records = [probe.records[s] for s in sorted(probe.records)]
        probe.info["loss_inputs"] = probe.loss_inputs
        Path(spec["out"]).write_text(json.dumps({"info": probe.info, "records": records}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip gloo's teardown at exit, which can abort a finished process


def plan_worker(spec_path: Path) -> None:
    """``minippo plan``'s figures for the recipe's config (the engine planned on the GPU, as the
    real run places it; the dry run's config only moves it to CPU cores to run there). The
    fake-tensor step runs the CUDA kernels where torch sees a GPU, else the CPU kernels."""
    from minippo.config import load_config
    from minippo.plan import measure_from_config, plan_from_config

    spec = json.loads(spec_path.read_text())
    t0 = time.perf_counter()
    cfg = load_config(spec["config"], [*spec["overrides"], "engine.device=cuda"])
    gpu_gib = spec["gpu_mem_gib"]
    if torch.cuda.is_available():  # this GPU's memory, for the plan's verdict
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    plan = plan_from_config(cfg, gpu_mem_gib=gpu_gib, world_size=1, device="cuda")
    plan.measured = measure_from_config(cfg, gpu_mem_gib=gpu_gib, world_size=1, device="cuda")
    engine = sum(i.device for i in plan.items if i.name.startswith("engine"))
    context = sum(i.device for i in plan.items if i.name.startswith("CUDA"))
    generation = plan.generation_total()
    out = {
        "gpu_mem_gib": gpu_gib,
        "measured_on": plan.measured.device,  # the fake-tensor step's kernels
        "seconds": time.perf_counter() - t0,
        "generation_bytes": generation,
        "generation_engine_bytes": engine,
        "generation_trainer_bytes": generation - engine - context,
        "cuda_context_bytes": context,
        "offloaded_bytes": plan.offloaded if plan.inputs.offload_trainer else 0,
        "training_bytes": plan.training_total,
        "training_tensor_bytes": plan.training_total - context,  # the measured step's device part
        "training_formula_bytes": plan.formula_trainer_total,
        "fits": plan.fits,
        "table": plan.table(),
        "cuda_step_error": spec.get("cuda_step_error"),
    }
    Path(spec["out"]).write_text(json.dumps(out))


def start_plan(
    dry_run: bool, work: Path, gpu_mem_gib: float, cuda_step_error: str | None = None
) -> SimpleNamespace:
    """The plan worker in the background (CPU work, while the tiny runs use the GPU); with
    ``cuda_step_error`` (the fake-tensor step failed with CUDA kernels) on the CPU kernels."""
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "plan_spec.json"
    out = work / "plan.json"
    overrides = list(RECIPE_DRY_OVERRIDES if dry_run else [])
    spec.write_text(
        json.dumps(
            {"config": str(RECIPE_CONFIG), "overrides": overrides, "out": str(out),
             "gpu_mem_gib": gpu_mem_gib, "cuda_step_error": cuda_step_error}
        )
    )  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--plan-worker", str(spec)]
    env = _env(CUDA_VISIBLE_DEVICES="") if cuda_step_error else _env()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    args = SimpleNamespace(dry_run=dry_run, work=work, gpu_mem_gib=gpu_mem_gib)
    return SimpleNamespace(proc=proc, out=out, args=args, retried=cuda_step_error is not None)


def finish_plan(run: SimpleNamespace, timeout_s: float) -> dict[str, Any] | None:
    """The plan's figures; if the step failed with CUDA kernels (never run where the plan's
    figures in the docs come from: a CPU machine), once more with the CPU kernels, saying so."""
    try:
        _, err = run.proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        _, err = run.proc.communicate()
    if run.proc.returncode == 0 and run.out.exists():
        return json.loads(run.out.read_text())
    print(f"[plan] failed (exit {run.proc.returncode}):\n{err[-2000:]}", file=sys.stderr)
    if run.retried or not torch.cuda.is_available():
        return None
    last = (err.strip().splitlines() or ["no output"])[-1][:300]
    retry = start_plan(run.args.dry_run, run.args.work, run.args.gpu_mem_gib, last)
    return finish_plan(retry, timeout_s)


ENVIRONMENT_KEYS = (
    "torch", "cuda", "device", "nccl", "backend", "gpu_total_bytes", "shm_total_bytes", "recipe_s",
)  # fmt: skip
PLAN_KEYS = (
    "gpu_mem_gib", "measured_on", "seconds", "generation_bytes", "generation_engine_bytes",
    "generation_trainer_bytes", "cuda_context_bytes", "offloaded_bytes", "training_bytes",
    "training_tensor_bytes", "training_formula_bytes", "fits", "table", "cuda_step_error",
)  # fmt: skip


def _step_from_metrics(row: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """One step of the recipe: its logged perf/ and rollout/ figures and the probe's record."""
    step = {
        "step": int(row["step"]),
        "generation_s": row.get("perf/rollout_s"),
        "engine_sleep_s": row.get("perf/engine_sleep_s"),
        "offload_s": row.get("perf/offload_s"),  # offload + reload
        "prepare_s": row.get("perf/prepare_s"),  # no-grad passes (critic values, anchors)
        "train_s": row.get("perf/train_s"),  # PPO updates
        "publish_s": row.get("perf/publish_s"),  # the recipe's step 5, as the probe ran it
        "step_s": row.get("perf/step_s"),
        "tokens": row.get("rollout/tokens"),
        "tokens_per_s": row.get("perf/tokens_per_s"),  # response tokens / step seconds
        "generation_tokens_per_s": row.get("rollout/tokens_per_s"),
        "reward_mean": row.get("rollout/reward_mean"),
        "loss": row.get("train/loss"),
        "value_loss": row.get("train/value_loss"),
    }
    return {**step, **{k: v for k, v in rec.items() if k != "step"}}


def _recipe_summary(steps: list[dict[str, Any]], plan: dict[str, Any] | None) -> dict[str, Any]:
    """Medians over the steps after the first (warm-up: kernels, AdamW states), peaks over all,
    and the plan's two phases beside the measured ones."""
    steady = steps[1:] or steps
    gen = [s["generation"] for s in steps]
    train = [s["training"] for s in steps]
    pubs = [s["publish"] for s in steps]
    non_alloc = _max([g["non_allocator_bytes"] for g in gen])
    gen_device = _max(
        [
            _sum(g["trainer_peak_reserved"], g["engine_peak_reserved"], g["non_allocator_bytes"])
            for g in gen
        ]
    )
    # training: the trainer's reserved peak, the bytes no allocator holds (both processes'
    # CUDA contexts, NCCL) and what the sleeping engine still reserves
    train_device = _sum(
        _max([t["trainer_peak_reserved"] for t in train]),
        non_alloc,
        _max([g["engine_reserved_after_sleep"] for g in gen]),
    )
    timing = {
        "generation_s": _median([s["generation_s"] for s in steady]),
        "offload_s": _median([s["offload_s"] for s in steady]),
        "training_s": _median([_sum(s["prepare_s"], s["train_s"]) for s in steady]),
        "publish_s": _median([s["publish"]["applied_s"] for s in steady]),
        "publish_gb_per_s": _median([s["publish"]["gb_per_s"] for s in steady]),
        "checkpoint_s": _max([s["checkpoint_s"] for s in steps]),
        "step_s": _median([s["step_s"] for s in steady]),
        "tokens_per_s": _median([s["tokens_per_s"] for s in steady]),
        "generation_tokens_per_s": _median([s["generation_tokens_per_s"] for s in steady]),
    }
    memory = {
        "generation": {
            "trainer_peak_allocated": _max([g["trainer_peak_allocated"] for g in gen]),
            "trainer_peak_reserved": _max([g["trainer_peak_reserved"] for g in gen]),
            "engine_peak_allocated": _max([g["engine_peak_allocated"] for g in gen]),
            "engine_peak_reserved": _max([g["engine_peak_reserved"] for g in gen]),
            "non_allocator_bytes": non_alloc,
            "device_bytes": gen_device,  # both reserved peaks + what no allocator holds
        },
        "training": {
            "trainer_peak_allocated": _max([t["trainer_peak_allocated"] for t in train]),
            "trainer_peak_reserved": _max([t["trainer_peak_reserved"] for t in train]),
            "device_bytes": train_device,
        },
        # at each engine wake, after empty_cache(): what the trainer holds and keeps cached
        "wake": {
            "trainer_allocated": _max([p["trainer_allocated_at_wake"] for p in pubs]),
            "trainer_reserved": _max([p["trainer_reserved_at_wake"] for p in pubs]),
            "cached_over_live": _max(
                [
                    None
                    if p["trainer_reserved_at_wake"] is None
                    else p["trainer_reserved_at_wake"] - p["trainer_allocated_at_wake"]
                    for p in pubs
                ]
            ),
        },
    }
    p = plan or {}
    g_plan, t_plan = p.get("generation_bytes"), p.get("training_bytes")
    g_trainer = memory["generation"]["trainer_peak_allocated"]
    t_tensor = memory["training"]["trainer_peak_allocated"]
    plan_check = {
        "generation": {
            "plan_bytes": g_plan,
            "measured_bytes": gen_device,
            "ratio": _ratio(gen_device, g_plan),
            "holds": None if gen_device is None or g_plan is None else gen_device <= g_plan,
            "plan_engine_bytes": p.get("generation_engine_bytes"),
            "measured_engine_bytes": memory["generation"]["engine_peak_allocated"],
            "plan_trainer_bytes": p.get("generation_trainer_bytes"),
            "measured_trainer_bytes": g_trainer,
        },
        "training": {
            "plan_bytes": t_plan,
            "measured_bytes": train_device,
            "ratio": _ratio(train_device, t_plan),
            "holds": None if train_device is None or t_plan is None else train_device <= t_plan,
            "plan_tensor_bytes": p.get("training_tensor_bytes"),
            "measured_tensor_bytes": t_tensor,
            "tensor_ratio": _ratio(t_tensor, p.get("training_tensor_bytes")),
        },
        "cuda_context": {
            "plan_bytes": p.get("cuda_context_bytes"),
            "measured_non_allocator_bytes": non_alloc,
        },
    }
    return {"timing": timing, "memory": memory, "plan_check": plan_check}


def recipe_checks(
    step_list: list[dict[str, Any]],
    setup_publish: dict[str, Any],
    summary: dict[str, Any],
    *,
    backend: str | None,
    returncode: int,
    steps: int,
    cuda: bool,
    loss_inputs: dict[str, Any] | None = None,
    compilations: dict[str, int] | None = None,
) -> dict[str, bool | None]:
    """What the recipe check requires of a run. On CUDA also: after every ``sleep()`` the engine
    process holds at most SLEEP_LEFTOVER_BYTES; every ``offload()`` freed at least the bytes it
    moved (each moved tensor's device copy is freed; the allocator rounds sizes up, never down);
    the engine's peak covered its weights (the first publish's bytes). A CUDA figure that is
    missing fails its check there; on CPU these three are None."""
    losses = [s[k] for s in step_list for k in ("loss", "value_loss")]
    inputs = loss_inputs or {}
    checks: dict[str, bool | None] = {
        "exit_ok": returncode == 0,
        # the policy loss read every input in the dtype and with the values the recipe built
        "loss_inputs_exact": bool(inputs)
        and all(
            v["built"] == v["in_forward"] and v["changed_passes"] == 0 for v in inputs.values()
        ),
        "all_steps_logged": [s["step"] for s in step_list] == list(range(steps)),
        "finite_losses": bool(losses) and all(_finite(x) for x in losses),
        "backend": backend == ("nccl" if cuda else "gloo"),
        "sleep_frees": None,
        "offload_frees": None,
        "engine_on_gpu": None,
        # compile=true: at most the compile cache's 8 graphs (2 per grad mode and attention path
        # here), and no block left running eager after the recompile limit
        "compiled_blocks": None,
        # after each empty_cache() the trainer keeps at most the plan's allocator slack cached
        "wake_slack_within_margin": None,
    }
    if not cuda:
        return checks
    from minippo.plan.formula import ALLOCATOR_SLACK_BYTES

    c = compilations or {}
    checks["compiled_blocks"] = (
        c.get("graphs", 0) > 0 and c["graphs"] <= COMPILE_CACHE and c.get("eager_frames") == 0
    )
    slack = summary["memory"]["wake"]["cached_over_live"]
    checks["wake_slack_within_margin"] = slack is not None and slack <= ALLOCATOR_SLACK_BYTES
    gens = [s["generation"] for s in step_list]
    left = [(g["engine_allocated_after_sleep"], g["engine_reserved_after_sleep"]) for g in gens]
    checks["sleep_frees"] = bool(left) and all(
        None not in pair and max(pair) <= SLEEP_LEFTOVER_BYTES for pair in left
    )
    freed = [(s["offload_freed_bytes"], s["offload_bytes"]) for s in step_list]
    checks["offload_frees"] = bool(freed) and all(
        f is not None and n is not None and f >= n for f, n in freed
    )
    weights = setup_publish["bytes"]
    peak = summary["memory"]["generation"]["engine_peak_allocated"]
    checks["engine_on_gpu"] = weights is not None and peak is not None and peak >= weights
    return checks


def run_recipe_check(dry_run: bool, work: Path, steps: int, plan_run: Any, timeout_s: float):
    """The recipe under torchrun with the probe; merged with its metrics.jsonl and the plan."""
    out_dir = work / "recipe_run"
    spec_path, probe_out = work / "recipe_spec.json", work / "recipe_probe.json"
    overrides = [
        # on the GPU each decoder block compiled (compile_blocks): one graph per grad mode and
        # attention path whatever the depth, none left eager (docs/configs.md, `compile`)
        *(RECIPE_DRY_OVERRIDES if dry_run else ["compile=true"]),
        f"total_steps={steps}",
        f"output_dir={out_dir}",
        "progress_bar=false",
    ]
    spec_path.write_text(
        json.dumps(
            {"config": str(RECIPE_CONFIG), "overrides": overrides, "out": str(probe_out),
             "dry_run": dry_run}
        )
    )  # fmt: skip
    # the plan first: its process may hold a CUDA context (fake CUDA tensors), which must not
    # count in the run's device memory
    t0 = time.perf_counter()
    plan = finish_plan(plan_run, timeout_s=max(60.0, timeout_s)) if plan_run else None
    command = [*_torchrun(1), str(Path(__file__).resolve()), "--recipe-worker", str(spec_path)]
    run = _run(command, max(30.0, timeout_s - (time.perf_counter() - t0)))
    probe = json.loads(probe_out.read_text()) if probe_out.exists() else {"info": {}, "records": []}
    records = {r["step"]: r for r in probe["records"]}
    metrics_file = out_dir / "metrics.jsonl"
    from minippo.training.metrics import read_jsonl

    rows = read_jsonl(metrics_file) if metrics_file.exists() else []
    step_list = [
        _step_from_metrics(r, records.get(int(r["step"]), _step_skeleton(-1))) for r in rows
    ]
    summary = _recipe_summary(step_list, plan)
    setup_publish = records.get(-1, _step_skeleton(-1))["publish"]
    checks = recipe_checks(
        step_list,
        setup_publish,
        summary,
        backend=probe["info"].get("backend"),
        returncode=run.returncode,
        steps=steps,
        cuda=not dry_run,
        loss_inputs=probe["info"].get("loss_inputs"),
        compilations=probe["info"].get("compilations"),
    )
    ok = all(v for v in checks.values() if v is not None)
    return {
        "ok": ok,
        "status": "passed" if ok else "failed",
        "seconds": run.seconds,
        "config": str(RECIPE_CONFIG.relative_to(ROOT)),
        "overrides": overrides,
        # what a user types for the same run (the rehearsal starts the recipe with its probe)
        "cli_equivalent": "minippo run --nproc-per-node 1 async_ppo --config "
        + RECIPE_CONFIG.stem
        + " "
        + " ".join(f"'{o}'" if " " in o else o for o in overrides),
        "returncode": run.returncode,
        "environment": {k: probe["info"].get(k) for k in ENVIRONMENT_KEYS},
        "checks": checks,
        "setup_publish": setup_publish,
        # per field of the policy loss's spec: dtype as built, as read in forward, passes changed
        "loss_inputs": probe["info"].get("loss_inputs"),
        # device bytes the process group took beyond the allocator (NCCL buffers); None on CPU
        "nccl_bytes": probe["info"].get("nccl_bytes"),
        # torch.compile in the run: graphs, frames, frames left eager (minippo.parallel)
        "compilations": probe["info"].get("compilations"),
        "steps": step_list,
        **summary,
        "plan": {k: (plan or {}).get(k) for k in PLAN_KEYS},
        "stderr_tail": None if ok else (run.stdout[-1500:] + run.stderr[-3000:]),
    }


# ----------------------------------------------------------------------------------------------
# tiny_cpu on CUDA: the functional check (it must learn)

TINY_RUNS = {
    # as shipped: a plain process (the trainer on cuda:0 when there is one), the engine on CPU
    "overlap": ([], []),
    # the GPU path: one torchrun rank (NCCL), alternate, TorchEngine on the GPU, trainer offload
    "alternate": (
        ["--nproc-per-node", "1"],
        ["rollout.mode=alternate", "rollout.offload_trainer=true", "+engine.device=cuda"],
    ),
}


def run_tiny_check(dry_run: bool, work: Path, timeout_s: float) -> dict[str, Any]:
    """tiny_cpu through the CLI, each run of TINY_RUNS; learned = mean reward of the last 5
    steps >= TINY_THRESHOLD (not judged in the dry run: 3 steps)."""
    from minippo.training.metrics import read_jsonl

    steps = DRY_STEPS if dry_run else TINY_STEPS
    runs: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, (launcher, extra) in TINY_RUNS.items():
        if dry_run:  # the engine stays on CPU cores
            extra = [e.replace("+engine.device=cuda", "+engine.device=cpu") for e in extra]
        out = work / f"tiny_{name}"
        overrides = [*extra, f"total_steps={steps}", f"output_dir={out}", "progress_bar=false"]
        args = ["run", *launcher, "async_ppo", "--config", "tiny_cpu", *overrides]
        left = timeout_s - (time.perf_counter() - t0)
        # torchrun's --master-port default comes from PET_MASTER_PORT: a free one, not 29500
        run = _run(
            [sys.executable, "-m", "minippo._cli.main", *args],
            max(30.0, left),
            _env(PET_MASTER_PORT=str(_free_port())),
        )
        rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        rewards = [r["rollout/reward_mean"] for r in rows]
        last5 = statistics.fmean(rewards[-5:]) if rewards else None
        learned = None if dry_run else (last5 is not None and last5 >= TINY_THRESHOLD)
        complete = run.returncode == 0 and [r["step"] for r in rows] == list(range(steps))
        runs[name] = {
            "ok": complete and learned is not False,
            "command": "minippo " + " ".join(args),
            "returncode": run.returncode,
            "seconds": run.seconds,
            "steps": len(rows),
            "reward_first": rewards[0] if rewards else None,
            "reward_last5": last5,
            "threshold": TINY_THRESHOLD,
            "learned": learned,
            "step_s": _median([r.get("perf/step_s") for r in rows[1:]]),
            "stderr_tail": None if complete else (run.stdout[-1500:] + run.stderr[-3000:]),
        }
    ok = all(r["ok"] for r in runs.values())
    return {
        "ok": ok,
        "status": "passed" if ok else "failed",
        "seconds": time.perf_counter() - t0,
        "runs": runs,
    }


# ----------------------------------------------------------------------------------------------
# agent_store: torchrun's agent store and SGLang's scheduler child


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
        *_torchrun(2), str(Path(__file__).resolve()), "--agent-store-worker", str(work),
        "--child-timeout", str(child_timeout_s), *(["--control"] if control else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return SimpleNamespace(proc=proc, work=work, control=control, t0=time.perf_counter())


def finish_agent_store_check(run: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    try:
        _, stderr = run.proc.communicate(timeout=max(10.0, timeout_s))
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
# publish: gather, serialise as the backend does, unpickle with SGLang's allow-list


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
# torch_engine: TorchEngine vs the trainer


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
# ewma: the EWMA update and snapshot swap on a 4B/8 shard


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
# The report: one JSON, one screen


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


def not_run(reason: str) -> dict[str, Any]:
    return {"ok": None, "status": "not run", "reason": reason, "seconds": 0.0}


def _gib(n: Any) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _num(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


MARK = {"passed": "PASS", "failed": "FAIL", "not run": "----"}


def _recipe_lines(r: dict[str, Any]) -> list[str]:
    t, env, pc = r["timing"], r["environment"], r["plan_check"]
    lines = [
        f"recipe        {MARK[r['status']]}  {len(r['steps'])} steps of {r['config']} "
        f"({env['backend']}, {_num(r['seconds'], '.0f')} s)",
        f"  per step    generation {_num(t['generation_s'])} s, offload {_num(t['offload_s'])}"
        f" s, training {_num(t['training_s'])} s, publish {_num(t['publish_s'])} s "
        f"({_num(t['publish_gb_per_s'])} GB/s); {_num(t['tokens_per_s'], '.0f')} tok/s "
        f"(generation {_num(t['generation_tokens_per_s'], '.0f')}); checkpoint "
        f"{_num(t['checkpoint_s'], '.1f')} s",
    ]
    for phase in ("generation", "training"):
        m, c = r["memory"][phase], pc[phase]
        held = "-" if c["holds"] is None else ("holds" if c["holds"] else "EXCEEDED")
        detail = f"trainer {_gib(m['trainer_peak_allocated'])}/{_gib(m['trainer_peak_reserved'])}"
        if phase == "generation":
            detail += (
                f", engine {_gib(m['engine_peak_allocated'])}/{_gib(m['engine_peak_reserved'])}"
                f", other {_gib(m['non_allocator_bytes'])}"
            )
        lines.append(
            f"  {phase:<11} GiB measured {_gib(c['measured_bytes'])} ({detail} alloc/reserved)"
            f"  plan {_gib(c['plan_bytes'])}  {_num(c['ratio'])}x {held}"
        )
    w = r["memory"]["wake"]
    lines.append(
        f"  at wake     trainer {_gib(w['trainer_allocated'])} live, "
        f"{_gib(w['trainer_reserved'])} reserved after empty_cache (cached over live "
        f"{_gib(w['cached_over_live'])}); NCCL {_gib(r['nccl_bytes'])}"
    )
    c = r.get("compilations") or {}
    lines.append(
        f"  compile     {c.get('graphs', '-')} graphs, {c.get('frames', '-')} frames, "
        f"{c.get('eager_frames', '-')} left eager"
    )
    changed = {k: v for k, v in (r["loss_inputs"] or {}).items() if v["changed_passes"]}
    lines.append(
        "  loss inputs "
        + (
            "as built, in every pass"
            if r["loss_inputs"] and not changed
            else f"CHANGED in forward: {changed}"
            if changed
            else "not recorded"
        )
    )
    plan = r["plan"]
    if plan["measured_on"] is not None:
        failed = plan["cuda_step_error"]
        lines.append(
            f"  plan        fake-tensor step on {plan['measured_on']} kernels "
            f"({_num(plan['seconds'], '.0f')} s)"
            + (f"; with CUDA kernels it failed: {failed}" if failed else "")
        )
    checks = ", ".join(
        f"{k} {'-' if v is None else 'yes' if v else 'NO'}" for k, v in r["checks"].items()
    )
    lines.append(f"  checks      {checks}")
    if r.get("stderr_tail"):
        lines.append("  " + (r["stderr_tail"].strip().splitlines() or [""])[-1][:150])
    return lines


def _tiny_lines(r: dict[str, Any]) -> list[str]:
    return [
        f"tiny {name:<9} {'PASS' if run['ok'] else 'FAIL'}  reward {_num(run['reward_first'])} "
        f"-> {_num(run['reward_last5'])} (last 5, >= {run['threshold']}: "
        f"{'-' if run['learned'] is None else run['learned']}), {run['steps']} steps, "
        f"{_num(run['seconds'], '.0f')} s"
        for name, run in r["runs"].items()
    ]


def _publish_lines(r: dict[str, Any]) -> list[str]:
    return [
        f"publish       {'PASS' if s['ok'] else 'FAIL'}  {name}: bit_exact={s['bit_exact']} "
        f"{s['published_gib']:.3f} GiB in {len(s['buckets'])} buckets, "
        f"{s['publish_s_per_gib']:.2f} s/GiB, peak {_num(s['peak']['peak_gib'])} GiB"
        for name, s in r["shapes"].items()
    ]


def _one_line(name: str, detail: Any) -> Any:
    return lambda r: [f"{name:<14}{MARK[r['status']]}  {detail(r)}"]


SUMMARY = {
    "recipe": _recipe_lines,
    "tiny": _tiny_lines,
    "publish": _publish_lines,
    "torch_engine": _one_line(
        "torch_engine",
        lambda e: (
            f"|Δ logprob| mean {e['mean_abs_diff']:.2e} max {e['max_abs_diff']:.2e} over "
            f"{e['tokens']} tokens"
        ),
    ),
    "ewma": _one_line(
        "ewma",
        lambda w: (
            f"update {w['ewma_update_ms']:.2f} ms ({w['ewma_update_gib_per_s']:.0f} "
            f"GiB/s), swap {w['snapshot_swap_ms']:.2f} ms; goal < {w['goal_ewma_ms']:.0f} ms"
        ),
    ),
    "agent_store": _one_line(
        "agent_store",
        lambda a: (
            f"scheduler-like children joined: {a['ok']}; hang without the fix "
            f"reproduced: {a['hang_reproduced']}"
        ),
    ),
}


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The one-screen summary of a report (also for a report read back from its JSON)."""
    lines = [
        f"minippo GPU rehearsal{' (dry run, CPU)' if report['dry_run'] else ''}: "
        f"{report['device']}, torch {report['torch']}, {report['wall_s']:.0f} s "
        f"(budget {report['budget_s']:.0f} s)"
    ]
    for name in CHECKS:
        r = report[name]
        if "error" in r:  # the check raised: no figures, its error
            lines.append(f"{name:<14}FAIL  {r['error'][:150]}")
        elif r["status"] == "not run":
            lines.append(f"{name:<14}----  {r['reason']}")
        else:
            lines.extend(SUMMARY[name](r))
    plan = report["recipe"].get("plan_check", {})
    holds = [plan.get(k, {}).get("holds") for k in ("generation", "training")]
    plan_word = (
        "not measured" if None in holds else "holds" if all(holds) else "EXCEEDED in a phase"
    )
    lines.append(f"GPU path: {report['verdict']}; memory plan: {plan_word}  -> {report['out']}")
    return lines


def _write(report: dict[str, Any], out: Path) -> None:
    """Replace ``out`` atomically (a run cut short keeps the last complete report)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="where to write the JSON report")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, gloo (for CI)")
    p.add_argument("--sglang-wheel", type=Path, default=None, help="the pinned sglang wheel file")
    p.add_argument("--only", default=None, help=f"comma-separated checks among {','.join(CHECKS)}")
    p.add_argument("--skip", default=None, help="comma-separated checks to leave out")
    p.add_argument("--steps", type=int, default=None, help="recipe steps (default 4; dry run 3)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="start no check after")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp one)")
    p.add_argument("--bucket-mib", type=int, default=None, help="publish check's bucket size")
    p.add_argument("--no-control", action="store_true", help="skip the agent-store control run")
    p.add_argument("--agent-store-worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--recipe-worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan-worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=20.0, help=argparse.SUPPRESS)
    p.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.agent_store_worker is not None:
        agent_store_worker(a.agent_store_worker, a.child_timeout, a.control)
        return 0
    if a.recipe_worker is not None:
        recipe_worker(a.recipe_worker)
        return 0
    if a.plan_worker is not None:
        plan_worker(a.plan_worker)
        return 0

    # every input checked before any work
    if a.out is None:
        p.error("--out is required (the JSON report)")
    selected = list(CHECKS)
    for flag, value in (("--only", a.only), ("--skip", a.skip)):
        names = [n.strip() for n in (value or "").split(",") if n.strip()]
        unknown = [n for n in names if n not in CHECKS]
        if unknown:
            p.error(f"{flag}: unknown check(s) {unknown}; the checks are {', '.join(CHECKS)}")
        if value is not None:
            selected = [c for c in selected if (c in names) == (flag == "--only")]
    if a.dry_run:  # CPU only, also on a machine with a GPU: its runs inherit this
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if a.steps is not None and a.steps < 2:
        p.error(f"--steps must be >= 2 (the first step is a warm-up), got {a.steps}")
    if not a.dry_run and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run with --dry-run on CPU")
    wheel = None
    if "publish" in selected:
        from tests import sglang_pieces

        wheel = a.sglang_wheel or sglang_pieces.find_wheel()
        if wheel is None or not Path(wheel).is_file():
            p.error(
                f"the publish check needs the sglang wheel file ({a.sglang_wheel or 'none cached'}"
                f"): pass --sglang-wheel PATH (pip download --no-deps "
                f"sglang=={sglang_pieces.SGLANG_VERSION} on a machine with internet, and copy "
                "it), or --skip publish"
            )

    t_start = time.perf_counter()
    budget = a.budget_s
    work = a.work or Path(tempfile.mkdtemp(prefix="minippo_rehearsal_"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "schema": 1,
        "dry_run": a.dry_run,
        "device": "cpu" if a.dry_run else "cuda",  # named by the recipe run, or below
        "torch": torch.__version__,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget,
        "checks_selected": selected,
        "sglang_wheel": Path(wheel).name if wheel else None,
        "out": str(a.out),
        **{c: not_run("not selected") for c in CHECKS},
        "wall_s": 0.0,
        "ok": None,
        "verdict": "INCOMPLETE",
    }

    def left() -> float:
        return budget - (time.perf_counter() - t_start)

    def run_check(name: str, fn: Any) -> None:
        if name not in selected:
            return
        if left() <= 0:
            report[name] = not_run(f"budget of {budget:.0f} s spent before it started")
            return
        print(f"[{name}] running ({left():.0f} s of the budget left)", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # a check that crashes is a failed check, with its reason
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result.setdefault("seconds", time.perf_counter() - t0)
        result.setdefault("status", "passed" if result["ok"] else "failed")
        report[name] = result
        report["wall_s"] = time.perf_counter() - t_start
        _write(report, a.out)
        print(f"[{name}] {result['status']} in {time.perf_counter() - t0:.0f} s", flush=True)

    # CPU work in the background: the agent-store check and the plan of the recipe's config
    agent_store = None
    if "agent_store" in selected:
        agent_store = start_agent_store_check(
            child_timeout_s=2.0 if a.dry_run else 20.0, control=not a.no_control,
            work=work / "agent_store",
        )  # fmt: skip
    plan_run = None
    if "recipe" in selected:
        # the plan's verdict is against this GPU's memory (the worker reads it); the dry run's
        # against an H200's 141 GiB
        plan_run = start_plan(a.dry_run, work / "plan", 141.0)
    grace = 60.0  # a check may run this long past the budget before it is killed

    # the GPU runs first, in their own processes, while this process has not touched the GPU
    run_check("tiny", lambda: run_tiny_check(a.dry_run, work, left() + grace))
    steps = a.steps or (DRY_STEPS if a.dry_run else RECIPE_STEPS)
    run_check("recipe", lambda: run_recipe_check(a.dry_run, work, steps, plan_run, left() + grace))
    if plan_run is not None and plan_run.proc.poll() is None:
        plan_run.proc.kill()

    if any(c in selected for c in ("publish", "torch_engine", "ewma")):
        run_pieces(a, wheel, run_check)  # each records "not run" once the budget is spent
    if agent_store is not None:
        run_check("agent_store", lambda: finish_agent_store_check(agent_store, left() + grace))

    if not a.dry_run:
        report["device"] = report["recipe"].get("environment", {}).get("device") or (
            torch.cuda.get_device_name(0)
        )
    ran = [report[c] for c in selected]
    report["ok"] = all(r["ok"] for r in ran if r["status"] != "not run") and bool(ran)
    incomplete = any(r["status"] == "not run" for r in ran)
    report["verdict"] = "FAILED" if not report["ok"] else "INCOMPLETE" if incomplete else "OK"
    report["wall_s"] = time.perf_counter() - t_start
    _write(report, a.out)
    print("\n".join(summary_lines(report)))
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints of the 0.6B run: ~15 GB
    return {"OK": 0, "FAILED": 1}.get(report["verdict"], 3)


def run_pieces(a: Any, wheel: Any, run_check: Any) -> None:
    """publish, torch_engine and ewma in this process (a one-rank process group for FSDP2);
    ``run_check`` skips those not selected or past the budget."""
    import multiprocessing

    import torch.distributed as dist

    if a.dry_run:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    shapes = _shapes(a.dry_run)
    trainer: dict[str, Any] = {}
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        world_size=1,
        rank=0,
    )
    try:

        def publish() -> dict[str, Any]:
            from tests import sglang_pieces

            bucket_bytes = (a.bucket_mib or (1 if a.dry_run else 512)) << 20
            ctx = multiprocessing.get_context("spawn")
            here, there = ctx.Pipe()
            consumer = ctx.Process(target=sglang_pieces.digest_server, args=(str(wheel), there))
            consumer.start()  # stands for the engine's scheduler: spawned, SafeUnpickler
            out = {}
            try:
                for i, (name, args) in enumerate(shapes.items()):
                    out[name], model = check_publish(name, args, device, bucket_bytes, wheel, here)
                    if i == 0:
                        trainer["model"] = model  # the torch_engine check's trainer
                    del model
            finally:
                here.send(None)
                consumer.join(60)
                if consumer.is_alive():
                    consumer.kill()
            return {"ok": all(s["ok"] for s in out.values()), "shapes": out}

        def engine() -> dict[str, Any]:
            args = next(iter(shapes.values()))
            model = trainer.pop("model", None) or build_sharded(args, device, seed=1)
            result = check_torch_engine(model, args, device)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return result

        run_check("publish", publish)
        run_check("torch_engine", engine)
        trainer.clear()
        run_check("ewma", lambda: check_ewma(device, scale=1e-3 if a.dry_run else 1.0, repeats=10))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
