"""A resume continues what its checkpoint trained, and keeps the record of every launch.

The checkpoint's meta.json holds the resolved config it trained with; a resume that changes a
setting outside ``MAY_CHANGE_ON_RESUME`` (the algorithm, the model, the correction, the optimizer,
the batch shape, ...) is refused before any work by ``run`` and ``validate`` alike, in one line
naming the keys; each launch writes its resolved config to a file of its own."""

from __future__ import annotations

import json

from minippo.training.metrics import read_jsonl
from minippo.training.resume_settings import MAY_CHANGE_ON_RESUME, changed_settings
from tests.helpers import minippo_here
from tests.recipes.test_async_ppo import FAST, run_recipes


def test_changed_settings_names_each_key_outside_the_list():
    saved = {"seed": 0, "total_steps": 2, "ppo": {"epochs": 1, "micro_batch_size": 4},
             "correction": {"_component_": "a.EWMA", "cap": 2.0}, "eval": None}  # fmt: skip
    now = {"seed": 0, "total_steps": 9, "ppo": {"epochs": 2, "micro_batch_size": 8},
           "correction": {"_component_": "a.TIS"}, "eval": {"every_n_steps": 5}}  # fmt: skip
    assert changed_settings(saved, now) == [
        "correction._component_: 'a.EWMA' -> 'a.TIS'",
        "correction.cap: 2.0 -> (absent)",
        "ppo.epochs: 1 -> 2",
    ]
    assert changed_settings(saved, saved) == []
    assert "total_steps" in MAY_CHANGE_ON_RESUME and "seed" not in MAY_CHANGE_ON_RESUME


def test_resume_refuses_a_changed_algorithm_and_keeps_each_launchs_config(tmp_path):
    out = tmp_path / "run"
    common = [*FAST, f"output_dir={out}", "checkpoint.every_n_steps=1"]
    assert run_recipes([[*common, "total_steps=2"]]) == [None]
    before = sorted(p.name for p in out.rglob("*") if p.is_file())
    metrics = (out / "metrics.jsonl").read_bytes()

    changed = [*common, "total_steps=3", "resume_from=latest", "advantage_estimator=grpo"]
    for command in ("run", "validate"):
        args = [command, "async_ppo"] if command == "run" else [command]
        proc = minippo_here(*args, "--config", "tiny_cpu", *changed)
        assert proc.returncode != 0, proc.stdout
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) <= 2 and "advantage_estimator: 'gae' -> 'grpo'" in lines[-1], lines
        assert "Traceback" not in proc.stderr
    # nothing written by the refused launches
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == before
    assert (out / "metrics.jsonl").read_bytes() == metrics

    # what may change does: one more step
    assert run_recipes([[*common, "total_steps=3", "resume_from=latest"]]) == [None]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    first = json.loads((out / "metrics_config.json").read_text())
    second = json.loads((out / "metrics_config.2.json").read_text())
    assert (first["total_steps"], first["resume_from"]) == (2, None)
    assert (second["total_steps"], second["resume_from"]) == (3, "latest")
