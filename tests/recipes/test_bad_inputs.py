"""Every bad input ends in clear ``minippo: error:`` lines, before any work, and
``minippo validate`` agrees with ``minippo run``.

A table of cases, each: the command after ``minippo``, the exit code, a phrase the message must
contain, and whether the run may write anything (only the cases that must train a step to meet
the problem: a reward returning NaN, say). Every other case leaves ``output_dir`` (and any folder
it resumes) exactly as it was. Each config case also goes through ``minippo validate``, which
must report the same phrase (exit code 1), and its first problem must be the run's first error line:
both call one pre-flight function (``minippo._cli.main.preflight_problems``).

The commands run through the real CLI entry (``minippo._cli.main.main``), all in one subprocess
so that torch is imported once, each with its own file descriptors 1 and 2 and working folder;
``test_console_script_prints_one_line`` runs a few as separate ``python -m minippo`` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import minippo_here

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=8",
    "progress_bar=false",
    "checkpoint.export_hf=false",
    "engine.in_process=true",
]
TINY = ["run", "async_ppo", "--config", "tiny_cpu"]
PROMPT_FILE_DATASET = [
    "dataset._component_=minippo.data.load_prompt_dataset",
    "~dataset.op",
    "~dataset.length",
    "~dataset.alphabet",
    "~dataset.num_prompts",
    "~dataset.seed",
    "+dataset.template=plain",
]

REWARDS = textwrap.dedent(
    """\
    import math

    class NaNReward:
        def __call__(self, example, completion):
            return math.nan

    class NoneReward:
        def __call__(self, example, completion):
            return None

    class TextReward:
        def __call__(self, example, completion):
            return "good"

    class RaisingReward:
        def __call__(self, example, completion):
            return 1 / 0

    class Exact:
        def __call__(self, example, completion):
            return float(completion == example.answer)
    """
)


@dataclass
class Case:
    id: str
    argv: list[str]  # after `minippo`; {T} is the case's folder, {R} the shared resources
    code: int
    phrase: str | list[str]
    validate: bool = True  # also through `minippo validate` (config and file cases)
    writes: bool = False  # the run gets as far as training (runtime cases)
    out: str = "{T}/out"  # the output_dir whose state must not change (None: none given)
    extra: dict = field(default_factory=dict)


def run_case(id, *overrides, code=2, phrase, validate=True, **kw):
    """``minippo run async_ppo --config tiny_cpu output_dir={T}/out <overrides>``."""
    argv = [*TINY, "output_dir={T}/out", *overrides]
    return Case(id, argv, code, phrase, validate=validate, **kw)


def yaml_case(id, edit, phrase):
    """A copy of tiny_cpu.yaml edited by ``edit(text) -> text``, run with output_dir={T}/out."""
    return Case(
        id,
        ["run", "async_ppo", "--config", "{T}/my.yaml", "output_dir={T}/out"],
        2,
        phrase,
        extra={"yaml": edit},
    )


R = "{R}"
# fmt: off
CASES = [
    # ---- the command line and the config file
    Case("unknown_recipe", ["run", "nope", "--config", "tiny_cpu"], 2, "unknown recipe 'nope'",
         validate=False, out=None),
    Case("missing_recipe_file", ["run", "{T}/nope.py", "--config", "tiny_cpu"], 2,
         "does not exist", validate=False, out=None),
    Case("unknown_config", ["run", "async_ppo", "--config", "nope"], 2, "unknown config 'nope'",
         out=None),
    Case("missing_yaml", ["run", "async_ppo", "--config", "{T}/none.yaml"], 2, "does not exist",
         out=None),
    Case("config_is_a_folder", ["run", "async_ppo", "--config", R], 2, "is a folder", out=None),
    Case("missing_config_flag", ["run", "async_ppo"], 2, "missing --config", validate=False,
         out=None),
    yaml_case("yaml_syntax", lambda t: t + "\nbroken: [1, 2\n", "cannot parse config"),
    yaml_case("yaml_not_a_mapping", lambda t: "- a\n- b\n", "must be a YAML mapping"),
    yaml_case("yaml_empty", lambda t: "", "is empty (no keys); start from a built-in config"),
    yaml_case("yaml_only_comments", lambda t: "# my config\n", "is empty (no keys)"),
    yaml_case("yaml_misspelled_section", lambda t: t.replace("\nrollout:", "\nrollouts:"),
              "unknown config key 'rollouts' (the recipe does not read it); did you mean rollout?"),
    Case("builtin_config_as_a_file", ["run", "async_ppo", "--config", "tiny_cpu.yaml"], 2,
         "for the built-in config give its name: --config tiny_cpu", out=None),
    Case("config_before_recipe", ["run", "--config", "tiny_cpu", "async_ppo"], 2,
         "--config comes after the recipe: minippo run async_ppo --config tiny_cpu",
         validate=False, out=None),
    Case("unknown_launcher_flag", ["run", "--nprc", "2", "async_ppo", "--config", "tiny_cpu"], 2,
         "unrecognized arguments: --nprc", validate=False, out=None),
    Case("zero_ranks", ["run", "--nproc-per-node", "0", "async_ppo", "--config", "tiny_cpu",
                        "output_dir={T}/out"], 2,
         "--nproc-per-node 0: a run needs at least 1 rank per node"),
    Case("elastic_nodes", ["run", "--nnodes", "1:2", "async_ppo", "--config", "tiny_cpu",
                           "output_dir={T}/out"], 2,
         "--nnodes 1:2: minippo needs a fixed number of nodes"),
    yaml_case("yaml_misspelled_key", lambda t: t.replace("\nlr_scheduler:", "\nlr_schedular:"),
              "unknown config key 'lr_schedular' (the recipe does not read it); did you mean "
              "lr_scheduler?"),
    yaml_case("yaml_misspelled_nested_key",
              lambda t: t.replace("  max_staleness: 1", "  max_stalenes: 0"),
              "did you mean rollout.max_staleness?"),
    yaml_case("yaml_key_in_the_wrong_section", lambda t: t + "\nmax_staleness: 0\n",
              "did you mean rollout.max_staleness?"),
    yaml_case("yaml_missing_key", lambda t: t.replace("progress_bar: true", ""),
              "missing config key 'progress_bar' (true or false)"),
    run_case("override_unknown_key", "sead=1", phrase="unknown config key 'sead'"),
    run_case("override_without_value", "total_steps", phrase="is not of the form key=value"),
    run_case("flag_after_recipe", "--seed", "3", phrase="`seed=3`", validate=False),
    run_case("delete_unknown_key", "~nokey", phrase="cannot delete 'nokey'"),
    run_case("add_existing_key", "+seed=1", phrase="drop the '+'"),
    run_case("added_key_not_read", "+lr=1", phrase="unknown config key 'lr'"),
    run_case("broken_interpolation", "checkpoint.dir=${nope}/x", phrase="cannot resolve"),
    # ---- types and ranges
    run_case("total_steps_text", "total_steps=abc",
             phrase="total_steps must be an integer >= 1, got 'abc'"),
    run_case("total_steps_zero", "total_steps=0", phrase="total_steps must be an integer >= 1"),
    run_case("total_steps_fraction", "total_steps=2.5", phrase="got 2.5"),
    run_case("seed_text", "seed=abc", phrase="seed must be an integer >= 0, got 'abc'"),
    run_case("seed_negative", "seed=-1", phrase="seed must be an integer >= 0, got -1"),
    run_case("lr_negative", "optimizer.lr=-0.001",
             phrase="optimizer.lr must be a number > 0, got -0.001"),
    run_case("lr_nan", "optimizer.lr=.nan", phrase="optimizer.lr must be a number > 0, got nan"),
    run_case("lr_text_nan", "optimizer.lr=nan", phrase="got 'nan'"),
    run_case("critic_lr_zero", "critic.optimizer.lr=0", phrase="critic.optimizer.lr must be"),
    run_case("temperature_negative", "rollout.temperature=-1",
             phrase="rollout.temperature must be a number >= 0, got -1"),
    run_case("top_p_above_one", "rollout.top_p=2",
             phrase="rollout.top_p must be a number in (0, 1], got 2"),
    run_case("top_p_zero", "rollout.top_p=0", phrase="rollout.top_p must be a number in (0, 1]"),
    run_case("top_k_negative", "rollout.top_k=-1", phrase="rollout.top_k must be an integer >= 0"),
    run_case("max_new_tokens_zero", "rollout.max_new_tokens=0", phrase="rollout.max_new_tokens"),
    run_case("max_new_tokens_beyond_context", "rollout.max_new_tokens=100000",
             phrase="rollout.max_new_tokens=100000 plus a prompt of at least 1 token exceeds the "
                    "engine's context of 512 tokens (model.max_seq_len); set "
                    "rollout.max_new_tokens to at most 511"),
    # 511 fits a 1-token prompt (what the config tells); the built dataset's longer prompts do
    # not: the recipe checks again once its datasets exist, before any engine or model (the
    # output folder is claimed by then: its lock file is written)
    run_case("max_new_tokens_beyond_context_with_the_prompts", "rollout.max_new_tokens=511",
             phrase="rollout.max_new_tokens=511 plus the longest prompt of dataset",
             validate=False, writes=True),
    run_case("groups_zero", "rollout.groups_per_batch=0", phrase="rollout.groups_per_batch must"),
    run_case("samples_zero", "rollout.samples_per_prompt=0", phrase="samples_per_prompt must"),
    run_case("staleness_negative", "rollout.max_staleness=-1", phrase="rollout.max_staleness must"),
    run_case("partial_rollout_text", "rollout.partial_rollout=maybe",
             phrase="rollout.partial_rollout must be true or false, got 'maybe'"),
    run_case("stop_at_eos_number", "rollout.stop_at_eos=1", phrase="stop_at_eos must be true"),
    run_case("epochs_zero", "ppo.epochs=0", phrase="ppo.epochs must be an integer >= 1"),
    run_case("minibatches_zero", "ppo.minibatches=0", phrase="ppo.minibatches must be"),
    run_case("micro_batch_zero", "ppo.micro_batch_size=0", phrase="ppo.micro_batch_size must be"),
    run_case("clip_low_too_big", "ppo.clip_low=1.5", phrase="ppo.clip_low must be a number in"),
    run_case("clip_high_negative", "ppo.clip_high=-0.1", phrase="ppo.clip_high must be"),
    run_case("dual_clip_below_one", "ppo.dual_clip=0.5",
             phrase="ppo.dual_clip must be a number > 1"),
    run_case("value_clip_zero", "ppo.value_clip=0", phrase="ppo.value_clip must be a number > 0"),
    run_case("loss_agg_mode_unknown", "ppo.loss_agg_mode=mean",
             phrase="ppo.loss_agg_mode must be one of"),
    run_case("max_grad_norm_zero", "ppo.max_grad_norm=0", phrase="ppo.max_grad_norm must be"),
    run_case("whiten_number", "ppo.whiten_advantages=2", phrase="whiten_advantages must be true"),
    run_case("gamma_above_one", "gae.gamma=1.5", phrase="gae.gamma must be a number in [0, 1]"),
    run_case("lam_negative", "gae.lam=-0.1", phrase="gae.lam must be a number in [0, 1]"),
    run_case("kl_coef_negative", "kl.coef=-1", phrase="kl.coef must be a number >= 0"),
    run_case("kl_mode_unknown", "kl.mode=both", phrase="kl.mode must be one of ['loss', 'reward']"),
    run_case("kl_estimator_unknown", "kl.estimator=k9", phrase="kl.estimator must be one of"),
    run_case("every_n_steps_zero", "checkpoint.every_n_steps=0",
             phrase="checkpoint.every_n_steps must be an integer >= 1, got 0"),
    run_case("keep_last_zero", "checkpoint.keep_last=0", phrase="checkpoint.keep_last must be"),
    run_case("log_every_zero", "log_every_n_steps=0", phrase="log_every_n_steps must be"),
    run_case("nonfinite_limit_zero", "max_consecutive_nonfinite=0",
             phrase="max_consecutive_nonfinite must be"),
    run_case("bucket_zero", "publish_bucket_mb=0", phrase="publish_bucket_mb must be a number > 0"),
    run_case("dtype_unknown", "dtype=fp64", phrase="dtype must be a dtype, one of"),
    run_case("engine_dtype_unknown", "engine.dtype=int8", phrase="engine.dtype must be a dtype"),
    run_case("engine_batch_zero", "engine.max_batch_size=0", phrase="engine.max_batch_size must"),
    run_case("engine_cache_zero", "+engine.onednn_cache_capacity=0",
             phrase="engine.onednn_cache_capacity must"),
    run_case("cpu_threads_zero", "cpu_threads=0", phrase="cpu_threads must be an integer >= 1"),
    run_case("estimator_unknown", "advantage_estimator=vtrace",
             phrase="advantage_estimator must be one of ['gae', 'grpo'], got 'vtrace'"),
    run_case("progress_bar_number", "progress_bar=2", phrase="progress_bar must be true or false"),
    run_case("resume_from_number", "resume_from=5", phrase="resume_from must be a string or null"),
    run_case("section_replaced", "rollout=3", phrase="rollout must be a mapping, got 3"),
    run_case("several_problems", "total_steps=abc", "rollout.top_p=2", "optimizer.lr=-1",
             phrase=["total_steps must be", "rollout.top_p must be", "optimizer.lr must be"]),
    # ---- shapes, options and components
    run_case("grpo_one_sample", "advantage_estimator=grpo", "rollout.samples_per_prompt=1",
             phrase="rollout.samples_per_prompt (1) must be >= 2"),
    run_case("minibatches_do_not_divide", "ppo.minibatches=3", phrase="pick ppo.minibatches among"),
    run_case("micro_batch_does_not_divide", "ppo.micro_batch_size=7",
             phrase="divisible by ppo.micro_batch_size (7)"),
    run_case("warmup_too_long", "critic.warmup_steps=99",
             phrase="critic.warmup_steps (99) must be in [0, total_steps (60))"),
    run_case("kl_k1_as_loss", "kl.coef=0.1", "kl.mode=loss", "kl.estimator=k1",
             phrase="set kl.estimator=k2"),
    run_case("bf16_single_process", "dtype=bf16", phrase="minippo run --nproc-per-node 1"),
    run_case("async_critic_without_correction", "correction=null",
             phrase="correction._component_=minippo.rl.correction.EWMA"),
    run_case("correction_unknown", "correction._component_=minippo.rl.correction.Nope",
             phrase="cannot import 'minippo.rl.correction.Nope'"),
    run_case("correction_option_out_of_range", "correction.cap=0.5",
             phrase="correction.cap (c) must be > 1"),
    run_case("optimizer_misspelled", "optimizer._component_=torch.optim.AdamWW",
             phrase="did you mean torch.optim.AdamW"),
    run_case("optimizer_unknown_argument", "+optimizer.lrr=1",
             phrase="unknown keys: optimizer.lrr (did you mean lr?)"),
    run_case("component_missing", "~model._component_", phrase="model has no _component_ key"),
    Case("groups_not_divisible_by_ranks",
         ["run", "--nproc-per-node", "2", "async_ppo", "--config", "tiny_cpu",
          "output_dir={T}/out", "rollout.groups_per_batch=3"],
         2, "must be divisible by the number of ranks (2)"),
    Case("correction_missing_two_ranks",  # the contract fires once, in the launcher
         ["run", "--nproc-per-node", "2", "async_ppo", "--config", "tiny_cpu",
          "output_dir={T}/out", "correction=null"],
         2, "needs an explicit behaviour-policy correction", validate=False),
    # ---- files
    run_case("output_dir_is_a_file", out="{R}/a_file", phrase="is a file, not a folder",
             extra={"output_dir": "{R}/a_file"}),
    run_case("output_dir_not_writable", out="{R}/read_only/out", phrase="cannot write in",
             extra={"output_dir": "{R}/read_only/out"}),
    run_case("output_dir_holds_a_run", "total_steps=4",
             phrase=["holds another run's outputs", "resume that run with resume_from=latest"],
             extra={"resume": None}),
    run_case("output_dir_in_use", out="{R}/busy", phrase="is in use by another run (pid",
             extra={"output_dir": "{R}/busy"}),
    run_case("dataset_no_prompt_field", *PROMPT_FILE_DATASET, "+dataset.source=json",
             "+dataset.data_files={R}/no_prompt.jsonl",
             phrase="dataset.prompt_key='question': the rows of {R}/no_prompt.jsonl have no field "
                    "'question' (its fields: q, answer); set prompt_key to one of them"),
    run_case("dataset_parquet_no_answer_field", *PROMPT_FILE_DATASET, "+dataset.source=parquet",
             "+dataset.data_files={R}/good.parquet", "+dataset.answer_key=solution",
             phrase="dataset.answer_key='solution': the rows of {R}/good.parquet have no field"),
    run_case("checkpoint_dir_is_a_file", "checkpoint.dir={R}/a_file",
             phrase="checkpoint.dir={R}/a_file is a file"),
    run_case("metrics_path_is_a_folder", "metric_logger.path={R}",
             phrase="metric_logger.path={R} is a folder"),
    run_case("checkpoint_path_missing", "checkpoint_path={T}/no_model",
             phrase="checkpoint folder '{T}/no_model' does not exist"),
    run_case("config_json_corrupt", "checkpoint_path={R}/hf_bad_config",
             phrase="config.json' is corrupt or truncated"),
    run_case("safetensors_truncated", "checkpoint_path={R}/hf_truncated",
             phrase="model.safetensors' is truncated"),
    run_case("safetensors_garbage", "checkpoint_path={R}/hf_garbage",
             phrase="model.safetensors' is corrupt or truncated"),
    run_case("dataset_file_missing", *PROMPT_FILE_DATASET, "+dataset.source=json",
             "+dataset.data_files={T}/none.jsonl", phrase="{T}/none.jsonl does not exist"),
    run_case("dataset_file_empty", *PROMPT_FILE_DATASET, "+dataset.source=json",
             "+dataset.data_files={R}/empty.jsonl", phrase="empty.jsonl is empty"),
    run_case("dataset_not_json", *PROMPT_FILE_DATASET, "+dataset.source=json",
             "+dataset.data_files={R}/not_json.jsonl", phrase="is not JSON lines"),
    run_case("dataset_parquet_truncated", *PROMPT_FILE_DATASET, "+dataset.source=parquet",
             "+dataset.data_files={R}/truncated.parquet",
             phrase="is not a complete parquet file"),
    run_case("eval_dataset_file_missing",
             "eval={every_n_steps: 2, before_train: false, samples_per_prompt: 2, "
             "temperature: null, max_new_tokens: null, dataset: {_component_: "
             "minippo.data.load_prompt_dataset, source: json, data_files: {T}/none.jsonl}}",
             phrase="eval.dataset.data_files: {T}/none.jsonl does not exist"),
    run_case("vocab_smaller_than_tokenizer", "model.vocab_size=40",
             phrase="vocab_size (40) is smaller than the tokenizer's (51)"),
    run_case("stop_token_two_tokens", '+rollout.stop_tokens=["30"]',
             phrase="rollout.stop_tokens: '30' encodes to 2 tokens"),
    run_case("stop_tokens_not_strings", "+rollout.stop_tokens=[3]",
             phrase="rollout.stop_tokens must be null or a list of strings"),
    run_case("stop_tokens_not_a_list", "+rollout.stop_tokens=3",
             phrase="rollout.stop_tokens must be null or a list of strings"),
    run_case("vocab_larger_random_init", "model.vocab_size=64",
             phrase="samples ids the tokenizer cannot decode; set model.vocab_size=51"),
    run_case("tokenizer_folder_missing", "tokenizer._component_=minippo.models.load_tokenizer",
             "+tokenizer.path={T}/no_tok", phrase="tokenizer folder"),
    # ---- resuming
    run_case("resume_without_checkpoint", "resume_from=latest",
             phrase="no checkpoint was saved"),
    run_case("resume_from_not_a_checkpoint", "resume_from={R}",
             phrase=["is not a complete checkpoint",
                     "give a step_* folder (none is saved in {T}/out/checkpoints yet)"]),
    *[
        Case(f"resume_damaged_{name}", [*TINY, "output_dir={T}/out", *FAST, "total_steps=4",
             "resume_from=latest"], 2,
             [f"{file} is {what}", "resume_from={T}/out/checkpoints/step_000001"],
             extra={"resume": (file, how)})
        for name, file, how, what in [
            ("meta", "meta.json", "truncate", "corrupt or truncated"),
            ("metadata", ".metadata", "truncate", "corrupt or truncated"),
            ("distcp", "__0_0.distcp", "truncate", "truncated"),
            ("extra", "extra_rank0.pt", "truncate", "corrupt or truncated"),
            ("extra_missing", "extra_rank0.pt", "delete", "missing"),
        ]
    ],
    Case("resume_at_total_steps", [*TINY, "output_dir={T}/out", *FAST, "total_steps=2",
         "resume_from=latest"], 2, "is at step 2, but total_steps is 2; raise total_steps",
         extra={"resume": None}),
    Case("resume_with_other_world_size",
         ["run", "--nproc-per-node", "2", "async_ppo", "--config", "tiny_cpu",
          "output_dir={T}/out", *FAST, "total_steps=4", "resume_from=latest"],
         2, "written by 1 ranks but this run has 2; resume with --nproc-per-node 1",
         validate=False, extra={"resume": None}),
    # ---- problems met while training (the run starts, so it writes)
    *[
        run_case(f"reward_{name}", *FAST, "total_steps=2", f"reward._component_=my_rewards.{cls}",
                 code=1, phrase=[phrase, "prompt"], validate=False, writes=True,
                 extra={"cwd": "{R}/user"})
        for name, cls, phrase in [
            ("nan", "NaNReward", "reward my_rewards.NaNReward returned nan for prompt"),
            ("none", "NoneReward", "reward my_rewards.NoneReward returned None (a NoneType)"),
            ("text", "TextReward", "returned 'good' (a str)"),
            ("raises", "RaisingReward", "reward my_rewards.RaisingReward raised ZeroDivisionError"),
        ]
    ],
    run_case("user_reward_in_current_folder", *FAST, "total_steps=1",
             "reward._component_=my_rewards.Exact", code=0, phrase=[], validate=False,
             writes=True, extra={"cwd": "{R}/user"}),
    run_case("fewer_prompts_than_a_batch", *FAST, "total_steps=1", "dataset.num_prompts=5",
             code=0, phrase="the prompt stream cycles through it", validate=False, writes=True),
]
# fmt: on

DRIVER = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from minippo._cli.main import main

    results = []
    for case in json.loads(open(sys.argv[1]).read()):
        os.chdir(case["cwd"])
        sys.stdout.flush(); sys.stderr.flush()
        files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        saved = [os.dup(1), os.dup(2)]
        os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
        try:
            try:
                code = main(case["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        out = []
        for f in files:
            f.seek(0); out.append(f.read().decode(errors="replace"))
        results.append({"code": code, "stdout": out[0], "stderr": out[1]})
    open(sys.argv[2], "w").write(json.dumps(results))
    """
)


def _fill(value, T: Path, res: Path):
    if isinstance(value, str):
        return value.replace("{T}", str(T)).replace("{R}", str(res))
    if isinstance(value, list):
        return [_fill(v, T, res) for v in value]
    return value


def _state(path: Path) -> dict | None:
    """Every file under ``path`` with its size and mtime (None when ``path`` does not exist)."""
    if not path.exists():
        return None
    if path.is_file():
        st = path.stat()
        return {".": (st.st_size, st.st_mtime_ns)}
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
    }


def _cli_subprocess(*args: str, cwd: Path = REPO, timeout: float = 600):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "minippo", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def resources(tmp_path_factory) -> Path:
    """Files the cases read: damaged model folders and data files, a user reward module, and a
    finished 2-step run with a checkpoint after each step."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from minippo.models import Transformer, init_weights, qwen3_tiny, save_pretrained

    res = tmp_path_factory.mktemp("resources")
    (res / "a_file").write_text("not a folder\n")
    (res / "empty.jsonl").write_text("")
    (res / "not_json.jsonl").write_text("question,answer\n3012=,3012\n")
    pq.write_table(pa.table({"question": ["a"] * 50, "answer": ["b"] * 50}), res / "good.parquet")
    data = (res / "good.parquet").read_bytes()
    (res / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (res / "no_prompt.jsonl").write_text('{"q": "3012=", "answer": "3012"}\n')
    (res / "user").mkdir()
    (res / "user" / "my_rewards.py").write_text(REWARDS)
    (res / "read_only").mkdir()
    (res / "read_only").chmod(0o555)
    if os.access(res / "read_only", os.W_OK):  # root writes anywhere: a read-only mount then
        if os.access("/proc/sys", os.W_OK):
            pytest.skip("no folder that this user cannot write to")
        (res / "read_only").rmdir()
        (res / "read_only").symlink_to("/proc/sys")

    hf = res / "hf_good"
    save_pretrained(init_weights(Transformer(qwen3_tiny()), seed=0), hf)
    for name in ("hf_bad_config", "hf_truncated", "hf_garbage"):
        shutil.copytree(hf, res / name)
    text = (hf / "config.json").read_text()
    (res / "hf_bad_config" / "config.json").write_text(text[: len(text) // 2])
    weights = (hf / "model.safetensors").read_bytes()
    (res / "hf_truncated" / "model.safetensors").write_bytes(weights[: len(weights) - 1000])
    (res / "hf_garbage" / "model.safetensors").write_bytes(b"\xff" * 64)
    del torch

    run = res / "run"
    proc = _cli_subprocess(
        *TINY,
        f"output_dir={run}",
        *FAST,
        "total_steps=2",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=null",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def busy(resources):
    """``{R}/busy``: a folder whose lock a live process holds, as a running run does."""
    (resources / "busy").mkdir()
    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, f'pid {os.getpid()} on host, started now'.encode())\n"
        "print('locked', flush=True)\n"
        "time.sleep(3600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(resources / "busy" / ".minippo.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    yield resources / "busy"
    holder.kill()
    holder.wait()


def _prepare(case: Case, T: Path, res: Path) -> tuple[list[str], Path]:
    """The case's folder and files; returns (argv, cwd)."""
    T.mkdir(parents=True, exist_ok=True)
    argv = _fill(case.argv, T, res)
    if "yaml" in case.extra:
        (T / "my.yaml").write_text(
            case.extra["yaml"]((REPO / "configs" / "tiny_cpu.yaml").read_text())
        )
    if "output_dir" in case.extra:
        argv = [
            a
            if not a.startswith("output_dir=")
            else "output_dir=" + _fill(case.extra["output_dir"], T, res)
            for a in argv
        ]
    if "resume" in case.extra:
        shutil.copytree(res / "run", T / "out")
        damage = case.extra["resume"]
        if damage is not None:
            file, how = damage
            target = T / "out" / "checkpoints" / "step_000002" / file
            if how == "delete":
                target.unlink()
            else:
                target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 2)])
    cwd = Path(_fill(case.extra.get("cwd", str(REPO)), T, res))
    return argv, cwd


def _validate_argv(argv: list[str]) -> list[str]:
    """The `minippo validate` command of a `minippo run [launcher flags] async_ppo ...` command."""
    i = argv.index("--config")
    flags = []
    for flag in ("--nproc-per-node", "--nnodes"):
        if flag in argv[:i]:
            flags += [flag, argv[argv.index(flag) + 1]]
    return ["validate", *flags, *argv[i:]]


@pytest.fixture(scope="module")
def results(resources, busy, tmp_path_factory):
    """Runs every case (and its validate twin) once; {case id: (run result, validate result,
    state before, state after, filled phrases)}."""
    root = tmp_path_factory.mktemp("cases")
    jobs, meta = [], []
    for case in CASES:
        T = root / case.id
        argv, cwd = _prepare(case, T, resources)
        watched = Path(_fill(case.out, T, resources)) if case.out else None
        before = _state(watched) if watched else None
        jobs.append({"argv": argv, "cwd": str(cwd)})
        if case.validate:
            jobs.append({"argv": _validate_argv(argv), "cwd": str(cwd)})
        meta.append((case, T, watched, before))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("MINIPPO_LOG_LEVEL", None)
    # two driver processes, each on a contiguous half of the jobs (their imports overlap)
    halves, procs = [jobs[: len(jobs) // 2], jobs[len(jobs) // 2 :]], []
    for i, part in enumerate(halves):
        spec, out = root / f"jobs{i}.json", root / f"results{i}.json"
        spec.write_text(json.dumps(part))
        driver = [sys.executable, "-c", DRIVER, str(spec), str(out)]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append((subprocess.Popen(driver, cwd=REPO, env=env, **pipes), out))
    found = []
    for proc, out in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        found += json.loads(out.read_text())
    found = iter(found)
    table = {}
    for case, T, watched, before in meta:
        run = next(found)
        check = next(found) if case.validate else None
        after = _state(watched) if watched else None
        phrases = case.phrase if isinstance(case.phrase, list) else [case.phrase]
        table[case.id] = (run, check, before, after, _fill(phrases, T, resources))
    return table


def test_the_table_has_at_least_60_cases():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, results):
    run, check, before, after, phrases = results[case.id]
    err = run["stderr"]
    assert run["code"] == case.code, (run["code"], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    for phrase in phrases:
        assert phrase in err, (phrase, err[-2000:])
        assert err.count(phrase) == 1, err[-2000:]  # once: the launcher checks before torchrun
    if case.code != 0 and not case.writes:
        # nothing but the error lines, and nothing written
        lines = [x for x in err.splitlines() if x.strip()]
        assert lines and all(x.startswith("minippo: error: ") for x in lines), err[-2000:]
        assert before == after, "the output folder changed"
    if check is not None:  # `minippo validate` refuses the same config with the same words
        assert check["code"] == 1, (check["code"], check["stderr"][-2000:])
        assert "Traceback" not in check["stderr"]
        for phrase in phrases:
            assert phrase in check["stderr"], (phrase, check["stderr"][-2000:])
        assert before == after
        first_run = err.splitlines()[0].removeprefix("minippo: error: ")
        first_check = check["stderr"].splitlines()[1].removeprefix("  - ")
        assert first_check == first_run, (first_check, first_run)


def test_validate_reports_every_problem_at_once():
    proc = minippo_here(
        "validate",
        "--config",
        "tiny_cpu",
        "total_steps=abc",
        "seed=abc",
        "rollout.temperature=-1",
        "rollout.top_p=2",
        "optimizer.lr=-0.001",
        "checkpoint.every_n_steps=0",
    )
    assert proc.returncode == 1
    for key in (
        "total_steps",
        "seed",
        "rollout.temperature",
        "rollout.top_p",
        "optimizer.lr",
        "checkpoint.every_n_steps",
    ):
        assert f"  - {key} must be" in proc.stderr, (key, proc.stderr)
    ok = minippo_here("validate", "--config", "tiny_cpu", "rollout.max_staleness=4")
    assert ok.returncode == 0 and "well-formed" in ok.stdout, ok.stderr


def test_console_script_prints_one_line(tmp_path):
    """As a separate process: one line, no traceback, nothing written; DEBUG adds the traceback.
    (Each case's line, through the same code in this process: test_bad_input.)"""
    out = tmp_path / "out"
    proc = _cli_subprocess(*TINY, f"output_dir={out}", "rollout.temperature=-1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("minippo: error: rollout.temperature must be a number >= 0")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()
    env_debug = dict(os.environ, MINIPPO_LOG_LEVEL="DEBUG")
    proc = subprocess.run(
        [sys.executable, "-m", "minippo", *TINY, f"output_dir={out}", "seed=x"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env_debug,
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert "minippo: error: seed must be an integer >= 0, got 'x'" in proc.stderr


def test_home_folder_is_expanded(tmp_path):
    """``output_dir=~/x`` is the folder x in the home folder, for every path derived from it."""
    env = dict(os.environ, HOME=str(tmp_path))
    code = (
        "from minippo.config import load_config\n"
        "c = load_config('tiny_cpu', ['output_dir=~/x'])\n"
        "print(c.output_dir, c.checkpoint.dir, c.metric_logger.path)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    x = tmp_path / "x"
    assert proc.stdout.split() == [str(x), str(x / "checkpoints"), str(x / "metrics.jsonl")]
