"""``rollout.mode: alternate`` end to end: the schedule a GPU run uses, on CPU with TorchEngine.

The tiny task's responses all have 4 tokens, so every group of a step would finish at the same
decode step and none would be carried with tokens of an older version. For the span test a third
of the vocabulary also ends a response (more stop ids, as real tokenizers have several), which
gives the varying response lengths of real LLM rollouts.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from minippo.training.metrics import read_jsonl
from tests.helpers import minippo_here
from tests.recipes.seeds import SeedCount, check_seed_count
from tests.recipes.test_async_ppo import (
    FAST,
    REPO,
    SHIPPED,
    _env,
    assert_same,
    last_5,
    run_recipes,
    stable,
    tiny_cpu_seeds,
)

ALTERNATE = ["rollout.mode=alternate", "rollout.oversample=1.5"]

SCRIPT = textwrap.dedent(
    """
    import json, runpy, sys
    import minippo.models.tokenizer as tokenizer
    from minippo.config import load_config

    if __name__ == "__main__":
        plain_init = tokenizer.TinyTokenizer.__init__

        def init(self):
            plain_init(self)
            # a third of the vocabulary ends a response: lengths vary from 1 to 4
            self.eos_ids = (self.eos_id, *range(3, self.vocab_size, 3))

        tokenizer.TinyTokenizer.__init__ = init
        main = runpy.run_path(sys.argv[1])["recipe_main"]
        main(load_config(sys.argv[3] if len(sys.argv) > 3 else "tiny_cpu", json.loads(sys.argv[2])))
    """
)


def test_partial_rollouts_span_versions_with_exact_keep_old_actor_anchors(tmp_path):
    out = tmp_path / "run"
    overrides = [
        *FAST,
        *ALTERNATE,
        "total_steps=6",
        f"output_dir={out}",
        "rollout.partial_rollout=true",
        "rollout.max_new_tokens=12",
        "correction._component_=minippo.rl.correction.KeepOldActor",
        "~correction.reset_below",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO / "recipes/async_ppo.py"), json.dumps(overrides)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 6
    assert max(r["rollout/multi_version_fraction"] for r in rows) > 0  # a sample spans versions
    assert sum(r["rollout/carried_over"] for r in rows) > 0
    for r in rows:
        assert r["correction/version_mismatches"] == 0.0  # every token scored by its own version
        assert r["rollout/staleness_max"] <= 1  # max_staleness
        # snapshots: the latest version plus the versions the carried tokens reference
        assert 1 <= r["correction/snapshot_versions"] <= 2
        for key in ("perf/rollout_s", "perf/engine_sleep_s", "perf/engine_wake_s", "perf/train_s"):
            assert r[key] >= 0


# tiny_cpu in alternate mode with oversample 1.5: seeds whose final reward (the mean of the last 5
# steps) stays below 0.9 in a 20-seed sweep of the shipped settings (benchmarks/learning_sweep.py,
# 2-core AMD EPYC, torch 2.13.0; docs/learning.md): 0 of 20 (lowest 0.997; at lr 3e-3 0.998,
# and without the update bound 1 of 20, seed 8: 0.777, a late collapse; with 4 samples per
# prompt 4 of 96). Its rate before the fix was not measured, so the count catches a run that has
# stopped learning (tests/recipes/seeds.py).
ALTERNATE_SEEDS = SeedCount(seeds=range(10), at_least=7, bar=0.9, bad=(9, 10), good=(0, 20))


@pytest.mark.slow  # 10 runs of ~25 s, two at a time; learning is covered by default in test_recipe_properties.py
def test_tiny_cpu_alternate_with_oversample_learns(tmp_path):
    """Alternate mode with oversampling learns to >= 0.9 on (nearly) every seed: a count over
    10 seeds, chosen from the measured rate (tests/recipes/seeds.py)."""
    runs = tiny_cpu_seeds(tmp_path, ALTERNATE_SEEDS.seeds, *ALTERNATE, *SHIPPED)
    for rows in runs.values():
        assert all(r["rollout/groups_in_flight"] == 48 for r in rows)  # ceil(32 x 1.5)
    check_seed_count(last_5(runs), ALTERNATE_SEEDS, "alternate, mean reward of the last 5 steps")


def test_overlap_refuses_alternate_only_keys(tmp_path):
    for key in ("rollout.oversample=1.5", "rollout.offload_trainer=true"):
        proc = minippo_here("validate", "--config", "tiny_cpu", key)
        assert proc.returncode != 0
        assert "needs rollout.mode=alternate" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_alternate_refuses_what_it_cannot_run():
    """sync_every > 1 (the engine sleeps without its weights between publishes) and oversample
    with max_staleness 0 (every carried group would restart): one line each, before anything."""
    cases = {
        "rollout.sync_every=2": "rollout.sync_every=2 needs rollout.mode=overlap",
        "rollout.max_staleness=0": "set rollout.max_staleness>=1 or rollout.oversample=1.0",
    }
    for key, message in cases.items():
        proc = minippo_here("validate", "--config", "tiny_cpu", *ALTERNATE, key)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_trainer_offload_trains_exactly_like_no_offload(tmp_path):
    """rollout.offload_trainer moves the actor's and critic's state to the host and back around
    every generation: the run is bit for bit the same, and the time is logged."""
    runs = {
        flag: [*FAST, *ALTERNATE, "total_steps=3", f"output_dir={tmp_path / flag}",
               f"rollout.offload_trainer={flag}"]
        for flag in ("true", "false")
    }  # fmt: skip
    assert run_recipes(list(runs.values())) == [None, None]
    on, off = (read_jsonl(tmp_path / flag / "metrics.jsonl") for flag in runs)
    for a, b in zip(on, off):
        assert_same(stable(a), stable(b))
        assert a["perf/offload_s"] > 0 and b["perf/offload_s"] == 0
