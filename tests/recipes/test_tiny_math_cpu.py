r"""The tiny math job (configs/tiny_math_cpu.yaml) through the real CLI: it validates, runs 3 steps
with every sample scored by MathAnswerMatch and validation logged, and (slow) learns to write the right sum in
``\boxed{}``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minippo.config import instantiate, load_config
from minippo.data import MathAnswerMatch
from minippo.training.metrics import read_jsonl
from tests.helpers import minippo_here
from tests.recipes.seeds import SeedCount, check_seed_count, run_seeds

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "minippo._cli.main", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout,
    )  # fmt: skip


def test_config_builds_the_math_path():
    """The shipped nodes: prompts through the chat template, a vocabulary that holds the box,
    the real math reward."""
    cfg = load_config("tiny_math_cpu")
    tok = instantiate(cfg.tokenizer)
    assert cfg.model.vocab_size == tok.vocab_size == 53
    ds = instantiate(cfg.dataset, tokenizer=tok)
    assert len(ds) == cfg.dataset.num_prompts
    assert ds[0].prompt == tok.apply_chat_template([{"role": "user", "content": ds[0].prompt[:-1]}])
    reward = instantiate(cfg.reward)
    assert isinstance(reward, MathAnswerMatch)
    ex = ds[0]
    assert reward(ex, f"\\boxed{{{ex.answer}}}") == 1.0
    # the longest right completion fits: \boxed{ + digit + } + <eos>
    assert len(tok.encode(f"\\boxed{{{ex.answer}}}")) + 1 <= cfg.rollout.max_new_tokens


def test_validates_and_runs_three_steps(tmp_path):
    res = minippo_here("validate", "--config", "tiny_math_cpu")
    assert res.returncode == 0 and "well-formed" in res.stdout, res.stderr[-2000:]
    out = tmp_path / "run"
    proc = cli(
        "run", "async_ppo", "--config", "tiny_math_cpu", "total_steps=3", f"output_dir={out}",
        "progress_bar=false", "engine.in_process=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = read_jsonl(out / "metrics.jsonl")
    rows = [r for r in logged if "rollout/reward_mean" in r]
    evals = [r for r in logged if "eval/pass@1" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # validation before training and after the last step: the 16 questions x 8 samples
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        assert r["eval/prompts"] == 16 and r["eval/samples"] == 128
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@8"] <= 1.0
    for r in rows:
        assert r["rollout/tokens"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert 1.0 <= r["rollout/response_len_mean"] <= 4.0
        assert r["train/kl_loss"] >= 0.0  # k3 to the reference, in the loss
    assert rows[0]["rollout/staleness_mean"] == 0.0 and rows[-1]["rollout/staleness_mean"] == 1.0
    assert (out / "hf_export" / "config.json").is_file()


# tiny_math_cpu: seeds whose validation pass@1 at step 400 stays below 0.8 (benchmarks/
# learning_sweep.py --config tiny_math_cpu --score eval/pass@1, 2-core AMD EPYC, torch 2.13.0;
# docs/learning.md): 4 of 10 with the KL coefficient 0.05, 0 of 15 (seeds 0-14) with 0.1 as shipped.
# At least 10 of 12 seeds: a return to 4 misses in 10 passes 8% of the time, luck fails it 3%.
MATH_SEEDS = SeedCount(seeds=range(12), at_least=10, bar=0.8, bad=(4, 10), good=(0, 15))


@pytest.mark.slow  # 12 runs of 400 steps, two at a time: ~16 min on 2 cores
def test_tiny_math_cpu_learns(tmp_path):
    """The config as shipped, from ~0 to a validation pass@1 >= 0.8: a count over 12 seeds
    chosen from the measured rates (tests/recipes/seeds.py)."""

    def one(seed: int) -> float:
        out = tmp_path / f"seed{seed}"
        proc = cli(
            "run", "async_ppo", "--config", "tiny_math_cpu", f"seed={seed}", f"output_dir={out}",
            "progress_bar=false", timeout=2400,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        logged = read_jsonl(out / "metrics.jsonl")
        rows = [r for r in logged if "rollout/reward_mean" in r]
        evals = [r for r in logged if "eval/pass@1" in r]
        assert rows[0]["rollout/reward_mean"] < 0.05
        # the validation curve: every 20 steps and before training, from ~0
        assert [r["step"] for r in evals] == list(range(0, 401, 20))
        assert evals[0]["eval/pass@1"] < 0.05
        return evals[-1]["eval/pass@1"]

    check_seed_count(run_seeds(one, MATH_SEEDS.seeds), MATH_SEEDS, "validation pass@1 at step 400")
