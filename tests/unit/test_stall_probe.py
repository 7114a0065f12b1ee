"""scripts/stall_probe.py on a tiny run: its decomposition sums to the real gradient, every symbol
gets its pieces, and its hooks leave the run's rewards unchanged.

One probed and one unprobed run of the async_ppo recipe, in subprocesses (~35 s on a shared 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "stall_probe.py"

OVERRIDES = [
    "--config",
    "tiny_cpu",
    "total_steps=3",
    "rollout.groups_per_batch=8",
    "rollout.samples_per_prompt=4",
    "ppo.minibatches=2",
    "ppo.micro_batch_size=8",
    "progress_bar=false",
    "checkpoint.export_hf=false",
    "overwrite_output_dir=true",
]
GRAD_STEPS = 3
COMPS = ("own", "oth", "crit", "mean")

# `check` = |sum of the pieces - .grad| / |.grad| (2-norms over all actor parameters). Both sides
# add up the same per-token contributions, in different orders: .grad through the backward's
# weight-gradient reductions (16 sequences x 10 positions per minibatch, 2 micro-batches), the
# pieces one autograd.grad each (up to 4 targets x 5 sampled x 4 components = 80) and then summed.
# Summing n fp32 numbers in any order is off by at most ~n*u relative to the sum of their
# magnitudes (u = 2^-24 = eps/2), so n of a few hundred gives ~100-250 ulps (eps = 2^-23) in the
# worst case. The norm ratio is an average of the per-parameter errors, so the parameter count
# does not multiply it (the fp32 norms themselves add ~log2(#params) * u). 256 ulps = 3.1e-5;
# measured: 3e-7 to 7e-7. A piece left out (a component, a cell) makes `check` the size of that
# piece relative to the gradient: percents, not ulps.
CHECK_TOL = 256 * torch.finfo(torch.float32).eps


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _rewards(out_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]


@pytest.mark.slow
def test_stall_probe_decomposition_and_unchanged_run(tmp_path):
    from minippo.config._parse import parse_recipe_args

    alphabet = parse_recipe_args(OVERRIDES).dataset.alphabet
    probe_out = tmp_path / "probe.jsonl"
    probe = [sys.executable, str(SCRIPT), "--out", str(probe_out), "--grad-steps", str(GRAD_STEPS)]
    _run([*probe, "--", *OVERRIDES, f"output_dir={tmp_path / 'probed'}"])
    _run(
        [
            sys.executable,
            "-m",
            "minippo",
            "run",
            "async_ppo",
            *OVERRIDES,
            f"output_dir={tmp_path / 'plain'}",
        ]
    )

    lines = [json.loads(line) for line in probe_out.read_text().splitlines()]
    steps = [r for r in lines if r["kind"] == "step" and r["step"] < GRAD_STEPS]
    # one line per optimizer step (2 minibatches) of each probed step
    assert [(r["step"], r["mb"]) for r in steps] == [
        (s, mb) for s in range(GRAD_STEPS) for mb in range(2)
    ]
    # a zero gradient (all advantages 0, e.g. no reward yet) makes `check` 0 trivially
    nonzero = [r for r in steps if r["grad_norm"] > 0]
    assert len(nonzero) >= 2, [r["grad_norm"] for r in steps]
    for r in steps:
        assert 0 <= r["check"] < CHECK_TOL, (r["step"], r["mb"], r["check"])

        assert len(r["Q_before"]) == len(r["Q_after"]) == len(alphabet)
        terms = r["terms"]
        by_symbol = {s: set() for s in alphabet}
        for key, parts in terms.items():
            s, cell, comp = key.split("|")
            assert comp in COMPS, key
            by_symbol[s].add((cell, comp))
            for kind in ("sgd", "adam"):
                assert len(parts[kind]) == 3, key  # row, emb, body
                assert all(map(torch.isfinite, torch.tensor(parts[kind]))), key
        # every symbol gets the same pieces: every cell of the batch, each with all components
        cells = {cell for cell, _ in by_symbol[alphabet[0]]}
        for s in alphabet:
            assert by_symbol[s] == {(c, comp) for c in cells for comp in COMPS}, s
        if r["grad_norm"] > 0:
            assert cells

    probed, plain = _rewards(tmp_path / "probed"), _rewards(tmp_path / "plain")
    assert [s for s, _ in plain] == list(range(3))
    assert probed == plain  # exact: the hooks draw no random numbers and touch no .grad
