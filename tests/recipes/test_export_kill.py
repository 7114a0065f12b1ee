"""A run SIGKILLed while it writes its final HF export: the export is atomic (no half-written
``hf_export`` folder is ever visible), and ``resume_from=latest`` (the run is already at
``total_steps``) writes the export of the last checkpoint's actor and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from minippo.models import Transformer, from_pretrained
from minippo.parallel import exported_step
from minippo.training.checkpoint import Checkpointer
from minippo.training.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "run", "async_ppo", "--config", "tiny_cpu", "total_steps=2", "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4", "ppo.minibatches=2", "ppo.micro_batch_size=8", "progress_bar=false", "engine.in_process=true",
]  # fmt: skip

# The CLI with safetensors' writer patched: the process SIGKILLs itself right after the export's
# weights file is written (into hf_export.tmp), before the rename that completes the export.
KILLED_IN_EXPORT = textwrap.dedent(
    """\
    import os, signal, sys
    import safetensors.torch as st
    real = st.save_file
    def save_file(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        if "hf_export" in str(filename):
            os.kill(os.getpid(), signal.SIGKILL)
    st.save_file = save_file
    from minippo._cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _run(*args: str, killer: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    head = ["-c", KILLED_IN_EXPORT] if killer else ["-m", "minippo._cli.main"]
    return subprocess.run(
        [sys.executable, *head, *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip


def test_a_run_killed_during_its_export_finishes_the_export_on_resume(tmp_path):
    out = tmp_path / "run"
    killed = _run(*RUN, f"output_dir={out}", killer=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # the checkpoint of step 2 is complete, the export is not visible (only its .tmp folder)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (out / "hf_export").exists() and (out / "hf_export.tmp").is_dir()
    metrics = (out / "metrics.jsonl").read_text()

    resumed = _run(*RUN, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert exported_step(out / "hf_export") == 2 and not (out / "hf_export.tmp").exists()
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing trained or logged again
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    # the export holds exactly the actor of checkpoint 2
    exported = from_pretrained(out / "hf_export")
    actor = Transformer(exported.args)
    Checkpointer(out / "checkpoints").load_models(
        out / "checkpoints" / "step_000002", models={"actor": (actor, None)}
    )
    weights = exported.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in actor.state_dict().items())

    # now the run is complete: a second resume has nothing to do and says so
    again = _run(*RUN, f"output_dir={out}", "resume_from=latest")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "is at step 2, but total_steps is 2; raise total_steps" in again.stderr
