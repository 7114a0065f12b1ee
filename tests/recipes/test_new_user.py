"""What a new user meets first: the README's main job run twice, `minippo cp`, the examples of
the CLI's help, Ctrl-C while a run starts, `minippo run --help | head`, `minippo plan`'s notice.

Every run writes under the test's folder: the built-in configs name a new folder per launch under
/tmp/minippo/<config>/ (``${now:...}``), and a `minippo cp` copy of tiny_cpu, moved here, behaves
the same.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = [
    "total_steps=2",
    "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "progress_bar=false",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for key in ("MINIPPO_LOG_LEVEL", "MINIPPO_RUN_TIME"):
        env.pop(key, None)
    return env


def _cli(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minippo", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=timeout,
    )


def test_main_job_twice_keeps_both_runs(tmp_path):
    """`minippo cp tiny_cpu` gives the copy its own folder; two launches of it write two run
    folders; `latest` points at the second; eval and resume find it."""
    from minippo.config import load_config

    shipped = load_config("tiny_cpu")  # the README's main job: a new folder per launch
    assert re.fullmatch(r"/tmp/minippo/tiny_cpu/\d{8}-\d{6}", shipped.output_dir), (
        shipped.output_dir
    )
    eval_cfg = load_config("tiny_eval_cpu")
    assert eval_cfg.checkpoint_path == "/tmp/minippo/tiny_cpu/latest/hf_export"

    copy = tmp_path / "my_tiny.yaml"
    proc = _cli("cp", "tiny_cpu", str(copy))
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in copy.read_text().splitlines() if x.startswith("output_dir:"))
    assert line.startswith("output_dir: /tmp/minippo/my_tiny/${now:%Y%m%d-%H%M%S}"), line
    runs = tmp_path / "runs"  # the copy, moved here (a user edits the copy the same way)
    copy.write_text(copy.read_text().replace("/tmp/minippo/my_tiny/", f"{runs}/"))

    # each launch through the CLI's entry, in one process (torch is imported once); a launch
    # takes seconds, so the second names another second
    run = ["run", "async_ppo", "--config", str(copy), *SHORT]
    first, second = _in_one_process([run, run], cwd=tmp_path)
    folders = []
    for result in (first, second):
        assert result["code"] == 0, result["err"][-3000:]
        folders.append(Path(re.search(r"metrics: (\S+)/metrics.jsonl", result["out"]).group(1)))
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent == runs
    for folder in folders:
        steps = [json.loads(x)["step"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1] == 1, steps
        assert (folder / "hf_export" / "config.json").is_file()
    assert (runs / "latest").resolve() == folders[1].resolve()

    evaluate, resume, fresh_resume, explicit = _in_one_process(
        [
            # eval reads the newest finished run through `latest`
            ["validate", "--config", "tiny_eval_cpu", f"checkpoint_path={runs}/latest/hf_export",
             f"output_dir={tmp_path}/eval"],
            # resume names the run's folder (and keeps what the run trained: SHORT's batch)
            ["validate", "--config", str(copy), *SHORT, f"output_dir={runs}/latest",
             "resume_from=latest", "total_steps=4"],
            # a fresh launch that asks to resume is told where the earlier runs are
            ["validate", "--config", str(copy), "resume_from=latest", "total_steps=4"],
            # an explicit output_dir keeps one run per folder
            ["run", "async_ppo", "--config", str(copy), f"output_dir={folders[0]}", *SHORT],
        ],
        cwd=tmp_path,
    )  # fmt: skip
    assert evaluate["code"] == 0 and "well-formed" in evaluate["out"], evaluate["err"]
    assert resume["code"] == 0 and "well-formed" in resume["out"], resume["err"]
    hint = f"to resume the run in {folders[1]}: output_dir={folders[1]} resume_from=latest"
    assert fresh_resume["code"] == 1 and hint in fresh_resume["err"], fresh_resume["err"]
    assert explicit["code"] == 2 and "holds another run's outputs" in explicit["err"]


def _in_one_process(jobs: list[list[str]], cwd: Path) -> list[dict]:
    """Each `minippo <argv>` of ``jobs`` through the CLI's entry, in one subprocess: its exit
    code, stdout and stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(jobs)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


DRIVER = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from minippo._cli.main import main

    results = []
    for argv in json.loads(sys.argv[1]):
        sys.stdout.flush(); sys.stderr.flush()
        files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        saved = [os.dup(1), os.dup(2)]
        os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
        try:
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        out = []
        for f in files:
            f.seek(0); out.append(f.read().decode(errors="replace"))
        results.append({"argv": argv, "code": code, "out": out[0], "err": out[1]})
    print(json.dumps(results))
    """
)


# the files the help's examples name, made with `minippo cp` from these built-in names
EXAMPLE_FILES = {
    "my_tiny.yaml": "tiny_cpu",
    "my.yaml": "tiny_cpu",
    "my_16gpu.yaml": "qwen3_4b_dapo_math_8gpu",
    "my_recipe.py": "async_ppo",
    "my_ppo.py": "async_ppo",
}
# what the GPU configs read from the downloads the README lists; absent on a CPU machine
DOWNLOADS = re.compile(r"^  - (checkpoint_path=/models/\S+: checkpoint folder '/models/|"
                       r"(eval\.)?dataset.data_files: /data/\S+ does not exist)")  # fmt: skip

MAIN_JOB_LATEST = "/tmp/minippo/tiny_cpu/latest"
MAIN_JOB_FIRST = (
    f"  - checkpoint_path={MAIN_JOB_LATEST}/hf_export: checkpoint folder "
    f"'{MAIN_JOB_LATEST}/hf_export' does not exist ({MAIN_JOB_LATEST} is written when a run of "
    "the config whose folder it is ends well: run that first, or give the folder of a run)"
)


def _examples(help_text: str) -> list[list[str]]:
    """The `minippo ...` commands of a help text's examples (continuation lines joined)."""
    text = help_text.split("example:", 1)[-1].split("examples:", 1)[-1].replace("\\\n", " ")
    lines = [x.split("#")[0].strip() for x in text.splitlines()]
    return [shlex.split(x)[1:] for x in lines if x.startswith("minippo ")]


def _as_validate(argv: list[str]) -> list[str]:
    """`minippo validate` of a `minippo run [launcher flags] <recipe> --config ...` example."""
    i = argv.index("--config")
    recipe, flags = argv[i - 1], []
    for flag in ("--nproc-per-node", "--nnodes"):
        if flag in argv[:i]:
            flags += [flag, argv[argv.index(flag) + 1]]
    return ["validate", "--recipe", recipe, *flags, *argv[i:]]


def test_help_examples_are_valid(tmp_path):
    """Every example of `minippo --help`, `run --help`, `validate --help` and `cp --help` is
    accepted: `run` examples through `minippo validate` (the same checks), the others as they
    are. A GPU config may only miss its model and data downloads."""
    helps = [_cli(*args) for args in (["--help"], ["run", "--help"], ["validate", "--help"],
                                      ["cp", "--help"], ["ls", "--help"])]  # fmt: skip
    examples = [e for h in helps for e in _examples(h.stdout)]
    assert len(examples) >= 15, examples
    for name, builtin in EXAMPLE_FILES.items():  # `minippo cp` writes what the examples read
        assert _cli("cp", builtin, name, cwd=tmp_path).returncode == 0
    jobs = []
    for argv in examples:
        if argv[0] == "cp":
            argv = [*argv, "--force"] if "--force" not in argv else argv
        if argv[0] == "run":
            argv = _as_validate(argv)
        if argv[0] == "plan":
            continue  # the memory plan's own tests run it (tests/unit/test_memory_plan*.py)
        jobs.append(argv)
    files = {a.removeprefix("./") for argv in jobs for a in argv if a.startswith(("my", "./my"))}
    assert files <= set(EXAMPLE_FILES) | {"configs/"}, files - set(EXAMPLE_FILES)
    (tmp_path / "configs").mkdir()
    for result in _in_one_process(jobs, cwd=tmp_path):
        argv, code, err = result["argv"], result["code"], result["err"]
        problems = [x for x in err.splitlines() if x.startswith("  - ")]
        if code == 1 and problems and all(DOWNLOADS.match(x) for x in problems):
            continue  # a GPU config without its downloads: every key and value is right
        export = Path(MAIN_JOB_LATEST) / "hf_export"
        if code == 1 and len(problems) == 1 and problems[0].startswith(MAIN_JOB_FIRST[:80]):
            assert not export.exists(), (argv, err)
            continue  # the evaluation of the main job's export, before the main job exported
        assert code == 0, (argv, err[-2000:])


def _children(pid: int) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                found.append(int(d))
    return found


@pytest.fixture(scope="module")
def ctrl_c(tmp_path_factory) -> subprocess.CompletedProcess:
    """The main job, with Ctrl-C (SIGINT to the process group) pressed while its engine process
    is still importing torch."""
    tmp_path = tmp_path_factory.mktemp("ctrl_c")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minippo", "run", "async_ppo", "--config", "tiny_cpu",
         f"output_dir={tmp_path}/out", *SHORT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(),
        start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        if any(b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes() for k in kids):
            break
        time.sleep(0.02)
    time.sleep(0.3)  # the engine process imports torch for a few seconds
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_while_the_run_starts(ctrl_c):
    """Exit code 130 and a line that says "interrupted"; not "the engine process failed to
    start" (exit code 1)."""
    proc = ctrl_c
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("interrupted"), proc.stderr[-3000:]
    assert "failed to start" not in proc.stderr and "minippo: error" not in proc.stderr


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_while_the_run_starts_prints_no_traceback(ctrl_c):
    proc = ctrl_c
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_children_ignore_sigint():
    from minippo.training.interrupt import children_ignore_sigint

    before = signal.getsignal(signal.SIGINT)
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    with children_ignore_sigint():
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.stdout.strip() == "True", child.stderr
    assert signal.getsignal(signal.SIGINT) is before


def test_resume_hint_names_a_per_launch_folder(monkeypatch, tmp_path):
    from minippo.training import output_dir
    from minippo.training.interrupt import Interrupted

    assert (
        str(Interrupted(3, signal.SIGINT))
        == "interrupted at step 3; resume with resume_from=latest"
    )
    monkeypatch.setattr(output_dir, "claimed_per_launch", tmp_path / "20260101-000000")
    assert str(Interrupted(3, signal.SIGINT)).endswith(
        f"resume with resume_from=latest output_dir={tmp_path / '20260101-000000'}"
    )


def test_help_into_a_closed_pipe():
    """`minippo run --help | head`: no BrokenPipeError."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "minippo", "run", "--help"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_env(),
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the help is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and not err, err


def test_plan_tells_once_that_the_model_is_not_downloaded(capsys):
    """The actor's and the critic's folder are one; `minippo plan` reads the config twice."""
    from minippo.plan import config as plan_config

    for key in ("checkpoint_path", "critic.checkpoint_path", "checkpoint_path"):
        plan_config._args_from_hf_folder("/models/Qwen3-0.6B", key)
    assert capsys.readouterr().err.count("is not downloaded") == 1
