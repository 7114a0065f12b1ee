"""benchmarks/corrections_study.py --report: the cells of several invocations are read back from
the run folders' names, exactly as the grid named them, and unfinished runs are left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import corrections_study as study


def _finish(out: Path, cell, seed: int = 0) -> None:
    d = out / "runs" / cell.name / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "result.json").write_text("{}")


def test_every_cell_of_the_grid_reads_back_from_its_folder_name(tmp_path):
    grid = study.cells([0, 4], list(study.METHODS), list(study.DISCREPANCY), list(study.REGIMES))
    assert any(c.regime == "partial" for c in grid) and any("_" in c.method for c in grid)
    for cell in grid:
        _finish(tmp_path, cell)
    got = study.finished_cells(tmp_path)
    assert sorted(got, key=lambda c: c.name) == sorted(grid, key=lambda c: c.name)
    # synchronous baselines first within an engine, engines in the order of DISCREPANCY
    assert got[0] == study.Cell("fp32", 0, "none")
    assert [c.discrepancy for c in got] == sorted(
        (c.discrepancy for c in got), key=list(study.DISCREPANCY).index
    )


def test_a_run_without_its_result_is_not_a_cell(tmp_path):
    done = study.Cell("int4", 4, "keep_old_actor", "partial")
    _finish(tmp_path, done)
    (tmp_path / "runs" / "bf16_s4_ewma_noreset" / "seed0").mkdir(parents=True)  # still running
    (tmp_path / "runs" / "notes_s_x").mkdir()  # not a cell
    assert study.finished_cells(tmp_path) == [done]
