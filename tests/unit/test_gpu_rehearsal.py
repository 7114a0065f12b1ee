"""scripts/gpu_rehearsal.py --dry-run, the checks of the SGLang backend's pieces (publish through
SGLang's unpickler, TorchEngine logprobs, EWMA, torchrun's agent store) on CPU (small shapes, gloo).

Marker ``network``: SGLang's SafeUnpickler comes from the pinned wheel (downloaded once by pip;
skipped with pip's reason when offline). The recipe and tiny checks: test_gpu_rehearsal_recipe.py.
The real run needs one CUDA GPU (tests/gpu).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import sglang_pieces

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]
QWEN3_4B_PARAMETERS = 4_022_468_096  # docs/sglang_backend.md


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    try:
        sglang_pieces.download_wheel()
    except RuntimeError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("rehearsal") / "dry.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "gpu_rehearsal.py"), "--dry-run", "--out",
            str(out), "--only", "publish,torch_engine,ewma,agent_store",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "GPU path: OK" in proc.stdout
    return json.loads(out.read_text())


def test_dry_run_writes_every_figure(dry_run):
    assert dry_run["ok"] and dry_run["dry_run"] and dry_run["device"] == "cpu"
    assert set(dry_run) >= {"agent_store", "publish", "torch_engine", "ewma", "wall_s"}
    for name in ("agent_store", "publish", "torch_engine", "ewma"):
        assert dry_run[name]["status"] == "passed", name


def test_scheduler_child_under_torchrun_joins_its_group(dry_run):
    """R5: a gloo child started as SGLang starts its scheduler, from each rank of a 2-rank
    torchrun, inside engine_launch_environment(), completes its init_process_group."""
    a = dry_run["agent_store"]
    assert a["ok"] and len(a["ranks"]) == 2
    for r in a["ranks"]:
        assert r["agent_store_env"] == "True"  # torchrun set it: the check is meaningful
        assert r["fixed"]["ok"] and r["fixed"]["exitcode"] == 0
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3]) < (2, 14, 1):
        assert a["hang_reproduced"] is True  # the same child, flag inherited: times out


def test_publish_is_bit_exact_through_sglangs_unpickler(dry_run):
    shapes = dry_run["publish"]["shapes"]
    assert set(shapes) == {"qwen3_0_6b_dry", "qwen3_1_7b_dry"}
    for r in shapes.values():
        assert r["bit_exact"] and r["all_weights_published"] and not r["mismatched_buckets"]
        assert r["consumer"].startswith("spawned process, SGLang's SafeUnpickler")
        assert math.isfinite(r["publish_s_per_gib"]) and r["publish_s_per_gib"] > 0
        assert sum(b["mib"] for b in r["buckets"]) == pytest.approx(r["published_gib"] * 1024)
        assert all(set(b) >= {"allocated_gib", "reserved_gib", "peak_gib"} for b in r["buckets"])
    assert len(shapes["qwen3_1_7b_dry"]["buckets"]) > 1  # several buckets: the loop is exercised


def test_torch_engine_and_ewma_figures(dry_run):
    t = dry_run["torch_engine"]
    assert t["tokens"] == 8 * 32 and math.isfinite(t["mean_abs_diff"]) and t["max_abs_diff"] >= 0
    e = dry_run["ewma"]
    assert e["parameters_at_scale_1"] == QWEN3_4B_PARAMETERS // 8  # 4B/8, FSDP's dim-0 split
    assert e["ewma_update_ms"] > 0 and e["snapshot_swap_ms"] > 0
