"""The eval recipe end to end: ``minippo run eval --config tiny_eval_cpu`` on a tiny HF folder
written here, on the actor of a short async_ppo run's checkpoint, on 1 and 2 ranks; bad inputs.

Runs go through the real CLI, or several ``recipe_main`` calls in one subprocess (torch imported
once). The model is a random tiny Qwen3, so ``correct_threshold=0.25`` (one of the 4 positions
right) makes pass@k something other than 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minippo.training.evaluation import pass_at_k, read_samples
from minippo.training.metrics import read_jsonl
from tests.helpers import minippo_here

REPO = Path(__file__).resolve().parents[2]
EVAL = ["run", "eval", "--config", "tiny_eval_cpu", "progress_bar=false", "correct_threshold=0.25"]
N, PROMPTS = 4, 64  # tiny_eval_cpu: samples_per_prompt, dataset.num_prompts


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minippo._cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=timeout,
    )


def run_evals(runs: list[list[str]], timeout: float = 300) -> None:
    """``recipe_main(load_config("tiny_eval_cpu", overrides))`` for each override list, in one
    subprocess."""
    code = textwrap.dedent(
        """
        import json, runpy, sys
        from minippo.config import load_config
        main = runpy.run_path(sys.argv[1])["recipe_main"]
        for overrides in json.loads(sys.argv[2]):
            main(load_config("tiny_eval_cpu", overrides))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "recipes" / "eval.py"), json.dumps(runs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def res(tmp_path_factory) -> Path:
    """A tiny HF folder (random init, TinyTokenizer's vocabulary) and a 2-step async_ppo run
    (checkpoint and HF export of its actor after step 2)."""
    from minippo.models import Transformer, init_weights, qwen3_tiny, save_pretrained

    root = tmp_path_factory.mktemp("eval")
    save_pretrained(init_weights(Transformer(qwen3_tiny(vocab_size=51)), seed=0), root / "hf")
    proc = cli(
        *("run", "async_ppo", "--config", "tiny_cpu", f"output_dir={root / 'run'}"),
        *("total_steps=2", "rollout.groups_per_batch=8", "rollout.samples_per_prompt=4"),
        *("ppo.minibatches=2",),
        *("ppo.micro_batch_size=8", "progress_bar=false", "engine.in_process=true"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def one_rank(res) -> tuple[Path, subprocess.CompletedProcess]:
    out = res / "one_rank"
    return out, cli(*EVAL, f"checkpoint_path={res / 'hf'}", f"output_dir={out}")


def test_cli_prints_pass_at_k_and_writes_one_row_per_sample(one_rank, res):
    out, proc = one_rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"eval of {res / 'hf'}: {PROMPTS} prompts x {N} samples" in proc.stdout
    printed = {
        line.split()[0]: float(line.split()[1])
        for line in proc.stdout.splitlines()
        if line.startswith("  eval/")
    }
    assert f"samples: {out / 'samples.jsonl'}" in proc.stdout

    rows = read_samples(out / "samples.jsonl")
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [
        (i, j) for i in range(PROMPTS) for j in range(N)
    ]
    for r in rows:
        assert r["correct"] == (r["reward"] >= 0.25) and r["finish_reason"] in ("stop", "length")
        assert r["prompt"].endswith("=") and r["answer"] == r["prompt"][:-1]  # the copy task
    (logged,) = read_jsonl(out / "metrics.jsonl")
    correct = [sum(r["correct"] for r in rows[i * N : (i + 1) * N]) for i in range(PROMPTS)]
    assert 0 < sum(correct) < PROMPTS * N
    # the logged metrics are those of the rows (pass@k: the estimator per prompt, averaged)
    expected = {
        "eval/reward_mean": sum(r["reward"] for r in rows) / (PROMPTS * N),
        "eval/pass@1": sum(correct) / (PROMPTS * N),
        f"eval/pass@{N}": sum(pass_at_k(N, c, N) for c in correct) / PROMPTS,
        "eval/response_len_mean": sum(r["response_len"] for r in rows) / (PROMPTS * N),
        "eval/truncated_frac": sum(r["finish_reason"] == "length" for r in rows) / (PROMPTS * N),
        "eval/prompts": PROMPTS,
        "eval/samples": PROMPTS * N,
    }
    assert logged.pop("step") == 0  # an HF folder: no training step
    # sums of <= 256 numbers of [0, 1] in another order: within 256 ulps of 1
    assert logged == pytest.approx(expected, abs=256 * 2.0**-52)
    assert printed == pytest.approx(expected, abs=5e-5)  # printed with 4 decimals


def test_training_checkpoint_is_its_actor_and_runs_repeat(res):
    """The actor read from the DCP checkpoint samples exactly what the HF export of the same
    weights samples; a second run gives the same rows and metrics."""
    ckpt, export = res / "run" / "checkpoints", res / "run" / "hf_export"
    run_evals(
        [
            ["checkpoint_path=null", f"training_checkpoint={ckpt}", f"output_dir={res / 'c'}"],
            [f"checkpoint_path={export}", f"output_dir={res / 'd'}"],
            [f"checkpoint_path={export}", f"output_dir={res / 'e'}"],
            [  # a step_* folder, as well as the checkpoint folder whose `latest` names it
                "checkpoint_path=null",
                f"training_checkpoint={ckpt / 'step_000002'}",
                f"output_dir={res / 'f'}",
                "dataset.num_prompts=4",
            ],
        ]
    )
    (c,), (d,), (e,) = (read_jsonl(res / x / "metrics.jsonl") for x in "cde")
    assert c.pop("step") == 2 and d.pop("step") == 0 and e.pop("step") == 0
    assert c == d == e
    rows = [read_samples(res / x / "samples.jsonl") for x in "cde"]
    assert rows[0] == rows[1] == rows[2] and len(rows[0]) == PROMPTS * N
    assert read_samples(res / "f" / "samples.jsonl") == rows[0][: 4 * N]


def test_stop_tokens_end_responses_at_the_stop_string(one_rank, res):
    """``sampling.stop_tokens``: a response ends at the first stop token (kept in the response,
    finish reason "stop"); a row without one runs as without the key."""
    out = res / "stop"
    proc = cli(
        *EVAL, f"checkpoint_path={res / 'hf'}", f"output_dir={out}", '+sampling.stop_tokens=["1"]'
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, plain = read_samples(out / "samples.jsonl"), read_samples(one_rank[0] / "samples.jsonl")
    stopped = [r for r in rows if "1" in r["response"]]
    assert len(stopped) >= 4  # the random model samples "1" in ~8% of its 4-token responses
    for r in stopped:
        assert r["response"].index("1") == len(r["response"]) - 1 and r["finish_reason"] == "stop"
    # the same seeds: a response is the plain run's up to and including its first "1"
    for r, p in zip(rows, plain, strict=True):
        cut = p["response"].find("1")
        assert r["response"] == (p["response"] if cut < 0 else p["response"][: cut + 1])


def test_two_ranks_give_the_metrics_and_rows_of_one_rank(one_rank, res):
    out = res / "two_ranks"
    proc = cli(
        "run",
        "--nproc-per-node",
        "2",
        *EVAL[1:],
        f"checkpoint_path={res / 'hf'}",
        f"output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("eval/pass@1") == 1  # rank 0 alone prints
    # same seeds per sample on any number of ranks, metrics summed exactly (math.fsum)
    assert read_jsonl(out / "metrics.jsonl") == read_jsonl(one_rank[0] / "metrics.jsonl")
    assert read_samples(out / "samples.jsonl") == read_samples(one_rank[0] / "samples.jsonl")


def validate(capsys, *args: str) -> tuple[int, str]:
    from minippo._cli.main import main

    code = main(["validate", *args])
    return code, capsys.readouterr().err


def test_bad_inputs_are_one_line_each(tmp_path, res, capsys):
    hf, ckpt = f"checkpoint_path={res / 'hf'}", res / "run" / "checkpoints"
    typo = tmp_path / "typo.yaml"  # a copied config with a misspelled key
    text = (REPO / "configs" / "tiny_eval_cpu.yaml").read_text()
    typo.write_text(text.replace("samples_per_prompt:", "samples_per_promt:"))
    cases = [
        (["--config", str(typo), hf], "unknown config key 'samples_per_promt'"),
        (["--config", "tiny_eval_cpu", hf, "pass_k=[1,5]"], "pass_k must be null or a list"),
        (["--config", "tiny_eval_cpu", hf, "samples_per_prompt=0"], "samples_per_prompt must be"),
        (["--config", "tiny_eval_cpu", "checkpoint_path=null"], "both null: nothing to evaluate"),
        (
            ["--config", "tiny_eval_cpu", f"training_checkpoint={tmp_path / 'nope'}"],
            "nope does not exist; give the checkpoint folder of an async_ppo run",
        ),
        (
            [
                "--config",
                "tiny_eval_cpu",
                "checkpoint_path=null",
                f"training_checkpoint={ckpt}",
                "model.vocab_size=64",
            ],
            "the actor's 'tok_embeddings.weight' is (51, 64), the configured model has (64, 64)",
        ),
        (["--config", "tiny_eval_cpu", "checkpoint_path=/nowhere"], "checkpoint_path=/nowhere"),
        (
            ["--config", "tiny_eval_cpu", hf, '+sampling.stop_tokens=["12"]'],
            "sampling.stop_tokens: '12' encodes to 2 tokens",
        ),
        (
            [
                "--config",
                "tiny_eval_cpu",
                "checkpoint_path=null",
                f"training_checkpoint={tmp_path}",
            ],
            f"training_checkpoint={tmp_path}: {tmp_path} is not a complete checkpoint",
        ),
    ]
    for args, phrase in cases:
        code, err = validate(capsys, *args)
        assert code == 1 and "config has 1 problem(s)" in err and phrase in err, (args, err)
    assert validate(capsys, "--config", "tiny_eval_cpu", hf) == (0, "")

    # `minippo run` refuses the same, in one line, before anything is written
    proc = minippo_here("run", "eval", "--config", str(typo), hf, f"output_dir={tmp_path / 'out'}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("minippo: error: unknown config key 'samples_per_promt'")
    assert not (tmp_path / "out").exists()


def test_ls_lists_and_cp_copies_the_eval_recipe(tmp_path, capsys):
    from minippo._cli.main import main

    assert main(["ls"]) == 0
    assert ["eval", "tiny_eval_cpu"] in [
        line.split() for line in capsys.readouterr().out.splitlines()
    ]
    assert main(["cp", "eval", str(tmp_path / "my_eval.py")]) == 0
    assert (tmp_path / "my_eval.py").read_text() == (REPO / "recipes" / "eval.py").read_text()
    assert main(["cp", "tiny_eval_cpu", str(tmp_path)]) == 0
    assert (tmp_path / "tiny_eval_cpu.yaml").is_file()


@pytest.mark.slow
def test_checkpoint_of_two_ranks_evaluates_like_its_export(tmp_path):
    """A checkpoint written by 2 FSDP2 ranks (sharded actor) read by one process: DCP gathers the
    shards; the samples equal those of the run's HF export."""
    run = tmp_path / "run"
    proc = cli(
        *("run", "--nproc-per-node", "2", "async_ppo", "--config", "tiny_cpu"),
        *(f"output_dir={run}", "total_steps=1", "rollout.groups_per_batch=8"),
        *("rollout.samples_per_prompt=4",),
        *("ppo.minibatches=2", "ppo.micro_batch_size=8", "progress_bar=false"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_evals(
        [
            [
                "checkpoint_path=null",
                f"training_checkpoint={run / 'checkpoints'}",
                f"output_dir={tmp_path / 'c'}",
            ],
            [f"checkpoint_path={run / 'hf_export'}", f"output_dir={tmp_path / 'd'}"],
        ]
    )
    assert read_samples(tmp_path / "c" / "samples.jsonl") == read_samples(
        tmp_path / "d" / "samples.jsonl"
    )
    shutil.rmtree(run)
