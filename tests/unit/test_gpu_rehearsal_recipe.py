"""scripts/gpu_rehearsal.py --dry-run, the recipe and tiny checks: the GPU rehearsal's code path
(the real recipe under torchrun, alternate with the engine sleeping, trainer offload, the
memory plan beside it; slow: tiny_cpu through the CLI both ways) on CPU with tiny shapes and gloo,
writing the JSON keys the GPU run writes. The checks that need the sglang wheel:
test_gpu_rehearsal.py; the GPU run itself: tests/gpu/test_gpu_rehearsal.py (it compares its keys
with a dry run's)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minippo.models import Transformer, ValueModel, qwen3_tiny

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SCRIPT = ROOT / "scripts" / "gpu_rehearsal.py"

# the figures docs/benchmarks.md reads, per section; None where a CPU cannot measure (CUDA memory)
STEP_KEYS = {
    "step", "generation_s", "engine_sleep_s", "offload_s", "prepare_s", "train_s", "publish_s",
    "step_s", "tokens", "tokens_per_s", "generation_tokens_per_s", "reward_mean", "loss",
    "value_loss", "offload_bytes", "offload_freed_bytes", "generation", "training", "publish",
    "checkpoint_s",
}  # fmt: skip
GENERATION_KEYS = {
    "trainer_peak_allocated", "trainer_peak_reserved", "engine_peak_allocated",
    "engine_peak_reserved", "device_used_before_sleep", "non_allocator_bytes",
    "engine_allocated_after_sleep", "engine_reserved_after_sleep", "device_used_after_sleep",
}  # fmt: skip
PUBLISH_KEYS = {
    "bytes", "wake_s", "push_s", "applied_s", "gb_per_s", "trainer_peak_allocated",
    "trainer_peak_reserved", "trainer_allocated_at_wake", "trainer_reserved_at_wake",
}  # fmt: skip
TIMING_KEYS = {
    "generation_s", "offload_s", "training_s", "publish_s", "publish_gb_per_s", "checkpoint_s",
    "step_s", "tokens_per_s", "generation_tokens_per_s",
}  # fmt: skip
CHECK_KEYS = {
    "exit_ok", "loss_inputs_exact", "all_steps_logged", "finite_losses", "backend",
    "sleep_frees", "offload_frees", "engine_on_gpu", "compiled_blocks", "wake_slack_within_margin",
}  # fmt: skip
CUDA_ONLY = ("sleep_frees", "offload_frees", "engine_on_gpu", "compiled_blocks",
             "wake_slack_within_margin")  # fmt: skip
# the tensor fields of the policy loss's spec the recipe fills (tis weights, no KL, no keep-mask
# for this config's correction are left out where the correction does not make them)
LOSS_INPUT_DTYPES = {"anchor_logprobs": "torch.float32", "advantages": "torch.float32",
                     "response_mask": "torch.float32"}  # fmt: skip
TINY_RUN_KEYS = {
    "ok", "command", "returncode", "seconds", "steps", "reward_first", "reward_last5",
    "threshold", "learned", "step_s", "stderr_tail",
}  # fmt: skip


def _dry_run(folder: Path, only: str) -> tuple[dict, str]:
    """``gpu_rehearsal.py --dry-run --only <only>``: its JSON report and its stdout."""
    out = folder / "r.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", only, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[dict, str]:
    return _dry_run(tmp_path_factory.mktemp("rehearsal"), "recipe")


def _numel(model_cls) -> tuple[int, int]:
    """(distinct parameter elements, parameter tensors) of the dry run's model shape."""
    with torch.device("meta"):
        params = list(model_cls(qwen3_tiny(1024)).parameters())
    return sum(p.numel() for p in params), len(params)


def test_report_and_summary(dry):
    report, stdout = dry
    assert report["dry_run"] and report["device"] == "cpu" and report["verdict"] == "OK"
    assert report["checks_selected"] == ["recipe"]
    for name in ("tiny", "publish", "torch_engine", "ewma", "agent_store"):
        assert report[name]["status"] == "not run" and report[name]["ok"] is None
    assert "GPU path: OK; memory plan: not measured" in stdout  # the summary's last line
    assert stdout.count("\n") < 60  # one screen


def test_recipe_runs_the_gpu_schedule_and_records_every_phase(dry):
    r = dry[0]["recipe"]
    assert r["ok"] and r["status"] == "passed" and r["returncode"] == 0
    assert set(r["checks"]) == CHECK_KEYS
    assert {k: r["checks"][k] for k in ("exit_ok", "all_steps_logged", "finite_losses")} == {
        "exit_ok": True, "all_steps_logged": True, "finite_losses": True,
    }  # fmt: skip
    assert r["checks"]["backend"] is True and r["environment"]["backend"] == "gloo"
    # bf16 FSDP2 compute: every loss input reached the loss as built, in every pass
    assert r["checks"]["loss_inputs_exact"] is True
    for name, dtype in LOSS_INPUT_DTYPES.items():
        entry = r["loss_inputs"][name]
        assert entry == {"built": dtype, "in_forward": dtype, "changed_passes": 0}, name
    assert r["nccl_bytes"] is None and set(r["memory"]["wake"].values()) == {None}  # CUDA only
    assert r["compilations"] == {"graphs": 0, "frames": 0, "eager_frames": 0}  # compile: false
    for cuda_only in CUDA_ONLY:
        assert r["checks"][cuda_only] is None
    assert [s["step"] for s in r["steps"]] == [0, 1, 2]
    assert set(r["timing"]) == TIMING_KEYS and set(r["setup_publish"]) == PUBLISH_KEYS
    p_actor, t_actor = _numel(Transformer)
    p_critic, t_critic = _numel(ValueModel)
    for s in r["steps"]:
        assert set(s) == STEP_KEYS and set(s["generation"]) == GENERATION_KEYS
        assert set(s["publish"]) == PUBLISH_KEYS
        assert all(v is None for v in (*s["generation"].values(), *s["training"].values()))
        for key in ("generation_s", "offload_s", "prepare_s", "train_s", "step_s", "tokens_per_s"):
            assert s[key] > 0, key
        assert s["tokens"] == 16 * 8  # 4 groups x 4 samples, every response 8 tokens long
        # every publish sends each distinct parameter once (the tied lm_head is the embedding)
        # in the engine's dtype, bf16
        assert s["publish"]["bytes"] == 2 * p_actor
        assert 0 <= s["publish"]["wake_s"] <= s["publish"]["push_s"] <= s["publish"]["applied_s"]
        # offload moves the actor's and critic's fp32 parameters, exp_avg and exp_avg_sq (4 + 4
        # bytes) and a 4-byte step count per parameter tensor: AdamW's state exists from setup
        assert s["offload_bytes"] == 12 * (p_actor + p_critic) + 4 * (t_actor + t_critic)
    assert r["setup_publish"]["bytes"] == 2 * p_actor
    assert r["steps"][-1]["checkpoint_s"] > 0  # the last step is always saved
    assert all(s["checkpoint_s"] is None for s in r["steps"][:-1])


def test_plan_beside_the_run(dry):
    r = dry[0]["recipe"]
    plan = r["plan"]
    p_actor, t_actor = _numel(Transformer)
    p_critic, t_critic = _numel(ValueModel)
    assert plan["measured_on"] == "cpu" and plan["fits"] is True
    assert plan["generation_bytes"] == (
        plan["generation_engine_bytes"] + plan["generation_trainer_bytes"]
        + plan["cuda_context_bytes"]
    )  # fmt: skip
    assert plan["cuda_context_bytes"] == 1 << 30  # the plan's assumed context
    # with rollout.offload_trainer the plan moves what the run moved: parameters, AdamW's two
    # moments and step counts
    assert plan["offloaded_bytes"] == 12 * (p_actor + p_critic) + 4 * (t_actor + t_critic)
    assert plan["offloaded_bytes"] == r["steps"][-1]["offload_bytes"]
    assert plan["generation_engine_bytes"] > 2 * p_actor  # weights + KV cache + working set
    assert plan["training_bytes"] == plan["training_tensor_bytes"] + plan["cuda_context_bytes"]
    assert "engine (TorchEngine)" in plan["table"]
    for phase in ("generation", "training"):
        c = r["plan_check"][phase]
        assert c["plan_bytes"] == plan[f"{phase}_bytes"]
        assert c["measured_bytes"] is None and c["ratio"] is None and c["holds"] is None


@pytest.mark.slow  # two CLI runs of tiny_cpu (~20 s); the same launches run by default elsewhere
def test_tiny_cpu_runs_through_the_cli_both_ways(tmp_path):
    tiny = _dry_run(tmp_path, "tiny")[0]["tiny"]
    assert tiny["ok"] and set(tiny["runs"]) == {"overlap", "alternate"}
    for name, run in tiny["runs"].items():
        assert set(run) == TINY_RUN_KEYS and run["ok"] and run["steps"] == 3, name
        assert run["learned"] is None and run["threshold"] == 0.8  # not judged in 3 steps
        assert 0 <= run["reward_first"] <= 1 and math.isfinite(run["reward_last5"])
    assert "--nproc-per-node 1" in tiny["runs"]["alternate"]["command"]
    assert "rollout.mode=alternate" in tiny["runs"]["alternate"]["command"]


@pytest.fixture(scope="module")
def rehearsal():
    spec = importlib.util.spec_from_file_location("gpu_rehearsal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_steps(rehearsal, left_mib: int, freed_less: int) -> list[dict]:
    """Two steps' records as a GPU run fills them (figures in MiB, chosen for the arithmetic)."""
    steps = []
    for i, (train_reserved, non_alloc) in enumerate([(20_000, 900), (21_000, 1_000)]):
        row = {"step": i, "train/loss": 0.0, "train/value_loss": 0.0}  # a metrics.jsonl line
        s = rehearsal._step_from_metrics(row, rehearsal._step_skeleton(i))
        s["offload_bytes"] = 13_000 * MIB
        s["offload_freed_bytes"] = 13_000 * MIB - freed_less
        s["generation"].update(
            trainer_peak_allocated=10 * MIB, trainer_peak_reserved=20 * MIB,
            engine_peak_allocated=4_800 * MIB, engine_peak_reserved=5_000 * MIB,
            non_allocator_bytes=non_alloc * MIB, engine_allocated_after_sleep=left_mib * MIB,
            engine_reserved_after_sleep=left_mib * MIB,
        )  # fmt: skip
        s["training"].update(
            trainer_peak_allocated=(train_reserved - 500) * MIB,
            trainer_peak_reserved=train_reserved * MIB,
        )
        s["publish"].update(  # after empty_cache(): 100 MiB more cached in the second step
            trainer_allocated_at_wake=3_000 * MIB, trainer_reserved_at_wake=(3_000 + 100 * i) * MIB
        )
        steps.append(s)
    return steps


PLAN = {"generation_bytes": 6_000 * MIB, "training_bytes": 22_000 * MIB,
        "training_tensor_bytes": 21_000 * MIB}  # fmt: skip


def test_the_gpu_only_checks_and_the_plan_comparison(rehearsal):
    """What only a GPU run fills, on figures written by hand: the CUDA checks pass and fail at
    their bounds, and each phase's measured bytes are the sums the docs describe."""

    exact = {"built": "torch.float32", "in_forward": "torch.float32", "changed_passes": 0}
    inputs = {"anchor_logprobs": exact, "advantages": exact}

    compiled = {"graphs": 4, "frames": 4, "eager_frames": 0}

    def checks(left_mib, freed_less, weights=1_100 * MIB, wake_slack_mib=None):
        steps = _cuda_steps(rehearsal, left_mib, freed_less)
        if wake_slack_mib is not None:
            steps[1]["publish"]["trainer_reserved_at_wake"] = (3_000 + wake_slack_mib) * MIB
        summary = rehearsal._recipe_summary(steps, PLAN)
        return rehearsal.recipe_checks(
            steps, {"bytes": weights}, summary, backend="nccl", returncode=0, steps=2, cuda=True,
            loss_inputs=inputs, compilations=compiled,
        ), summary  # fmt: skip

    ok, summary = checks(left_mib=64, freed_less=0)
    assert all(ok.values()), ok
    assert not checks(left_mib=65, freed_less=0)[0]["sleep_frees"]  # above 64 MiB
    assert not checks(left_mib=32, freed_less=1)[0]["offload_frees"]  # one byte short
    assert not checks(left_mib=32, freed_less=0, weights=4_801 * MIB)[0]["engine_on_gpu"]
    assert checks(left_mib=64, freed_less=0, wake_slack_mib=512)[0]["wake_slack_within_margin"]
    assert not checks(left_mib=64, freed_less=0, wake_slack_mib=513)[0]["wake_slack_within_margin"]
    compiled["eager_frames"] = 1  # a block left eager at the recompile limit
    assert not checks(left_mib=64, freed_less=0)[0]["compiled_blocks"]
    compiled.update(eager_frames=0, graphs=9)  # more graphs than the cache holds
    assert not checks(left_mib=64, freed_less=0)[0]["compiled_blocks"]
    compiled["graphs"] = 4
    inputs["anchor_logprobs"] = {**exact, "in_forward": "torch.bfloat16", "changed_passes": 3}
    assert not checks(left_mib=64, freed_less=0)[0]["loss_inputs_exact"]  # cast in forward
    gen, train = summary["plan_check"]["generation"], summary["plan_check"]["training"]
    # generation: trainer reserved + engine reserved + outside both allocators, the larger step
    assert gen["measured_bytes"] == (20 + 5_000 + 1_000) * MIB
    assert gen["ratio"] == (20 + 5_000 + 1_000) / 6_000 and gen["holds"] is False
    # training: the trainer's reserved peak + outside the allocators + the sleeping engine's 64
    assert train["measured_bytes"] == (21_000 + 1_000 + 64) * MIB and train["holds"] is False
    assert train["tensor_ratio"] == 20_500 / 21_000
    summary = rehearsal._recipe_summary(_cuda_steps(rehearsal, 0, 0), PLAN)
    assert summary["plan_check"]["training"]["holds"] is True  # 22,000 MiB: exactly the plan
    assert summary["timing"]["generation_s"] is None  # no perf figures given
    assert summary["memory"]["wake"] == {
        "trainer_allocated": 3_000 * MIB, "trainer_reserved": 3_100 * MIB,
        "cached_over_live": 100 * MIB,
    }  # fmt: skip


def test_bad_arguments_fail_in_one_line_before_any_work(tmp_path, capsys, rehearsal):
    out = tmp_path / "r.json"
    cases = {
        ("--only", "recipe,nope"): "unknown check(s) ['nope']",
        ("--skip", "tiny,recipe,x"): "unknown check(s) ['x']",
        ("--steps", "1"): "--steps must be >= 2",
        ("--only", "publish", "--sglang-wheel", str(tmp_path / "missing.whl")): "--skip publish",
    }
    for args, phrase in cases.items():
        with pytest.raises(SystemExit) as e:
            rehearsal.main(["--dry-run", "--out", str(out), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and phrase in err and "Traceback" not in err, err
        assert not out.exists()


def test_summary_of_a_gpu_report_and_of_a_crashed_check(dry, rehearsal):
    """The one screen renders the figures only a GPU run has, and a check that raised."""
    report = json.loads(json.dumps(dry[0]))
    steps = _cuda_steps(rehearsal, left_mib=32, freed_less=0)
    report["recipe"].update(rehearsal._recipe_summary(steps, PLAN), steps=steps)
    text = "\n".join(rehearsal.summary_lines(report))
    assert "generation  GiB measured 5.88" in text and "1.00x EXCEEDED" in text  # 6020/6000
    assert "training    GiB measured 21.52" in text  # (21,000 + 1,000 + 32) / 1024
    report["tiny"] = {"ok": False, "error": "RuntimeError: boom", "status": "failed"}
    report["verdict"] = "FAILED"
    text = "\n".join(rehearsal.summary_lines(report))
    assert "tiny          FAIL  RuntimeError: boom" in text
    assert text.splitlines()[-1].startswith("GPU path: FAILED; memory plan: EXCEEDED in a phase")
