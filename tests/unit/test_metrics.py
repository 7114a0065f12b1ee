"""Metric loggers: jsonl round trip, stdout, multi, no-op, clear errors for optional backends."""

import importlib.util
import io
import json
import math

import pytest
import torch

from minippo.training.metrics import (
    JsonlLogger,
    MetricAverager,
    MetricLogger,
    MultiLogger,
    NoOpLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
    read_jsonl,
    reduce_over_ranks,
)


def test_jsonl_round_trip_with_tensors_and_non_finite(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    lg = JsonlLogger(path)
    lg.log({"train/loss": torch.tensor(0.5), "rollout/n": 3}, step=0)
    lg.log({"train/loss": float("nan"), "train/grad_norm": float("inf")}, step=1)
    lg.log_config({"seed": 1, "output_dir": "x"})
    lg.close()
    lg.close()  # idempotent
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 0, "train/loss": 0.5, "rollout/n": 3.0}
    assert json.loads(lines[1])["train/loss"] == "nan"  # strict JSON, no bare NaN
    rows = read_jsonl(path)
    assert rows[0]["train/loss"] == 0.5
    assert math.isnan(rows[1]["train/loss"]) and rows[1]["train/grad_norm"] == math.inf
    assert json.loads((tmp_path / "sub" / "metrics_config.json").read_text())["seed"] == 1


def test_jsonl_resume_keeps_earlier_rows_and_rejects_non_numbers(tmp_path):
    path = tmp_path / "m.jsonl"
    lg = JsonlLogger(path)
    for s in range(4):  # an interrupted run logged steps 0..3, its last checkpoint was at step 2
        lg.log({"a": float(s)}, step=s)
    lg.close()
    lg = JsonlLogger(path)  # resumed at step 2: rows 2 and 3 are replaced, 0 and 1 kept
    lg.log({"a": 20.0}, step=2)
    with pytest.raises(TypeError, match="metric 'a' has a value of type str"):
        lg.log({"a": "x"}, step=3)
    lg.close()
    assert [(r["step"], r["a"]) for r in read_jsonl(path)] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    with pytest.raises(RuntimeError, match="closed"):
        lg.log({"a": 1.0}, step=3)
    fresh = JsonlLogger(path)  # a fresh run (first step 0) starts the file anew
    fresh.log({"a": 5.0}, step=0)
    fresh.close()
    assert [r["a"] for r in read_jsonl(path)] == [5.0]


def test_stdout_and_multi_logger():
    buf = io.StringIO()
    out = StdoutLogger(keys=["b", "a"], stream=buf)
    multi = MultiLogger([out, NoOpLogger()])
    multi.log({"a": 1.0, "b": 0.25, "c": 9.0}, step=4)
    multi.log_config({})
    multi.close()
    assert buf.getvalue() == "step 4 | b 0.25 | a 1\n"
    for lg in (out, NoOpLogger(), multi):
        assert isinstance(lg, MetricLogger)
    with pytest.raises(TypeError, match="item 0 is a dict"):
        MultiLogger([{"_component_": "x"}])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="installed")
def test_tensorboard_missing_gives_install_hint(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardLogger(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="installed")
def test_wandb_missing_gives_install_hint():
    with pytest.raises(ImportError, match="pip install wandb"):
        WandBLogger(project="p")


def test_plot_metrics_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from minippo.training.plot import plot_metrics

    path = tmp_path / "m.jsonl"
    lg = JsonlLogger(path)
    for s in range(5):
        lg.log({"rollout/reward_mean": s / 4, "train/loss": float("nan")}, step=s)
    lg.close()
    plot_metrics(path, ["rollout/reward_mean"], tmp_path / "r.png", hline=0.8, title="t")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="no finite values"):
        plot_metrics(path, ["train/loss"], tmp_path / "x.png")


def test_metric_averager_weighs_by_tokens_and_keeps_extremes():
    avg = MetricAverager()
    # two micro-batches: 3 tokens with clip fraction 1.0, 1 token with 0.0
    avg.add({"train/clip_frac_high": 1.0, "train/ratio_max": 1.5}, 3)
    avg.add({"train/clip_frac_high": 0.0, "train/ratio_max": 2.5}, 1)
    avg.add({"train/grad_norm": 2.0})  # per-minibatch values: weight 1 each
    avg.add({"train/grad_norm": 4.0})
    avg.add({"train/entropy": 0.7}, 0)  # a micro-batch without tokens counts for nothing
    out = avg.result()
    assert out["train/clip_frac_high"] == 0.75  # the unweighted mean would say 0.5
    assert out["train/ratio_max"] == 2.5
    assert out["train/grad_norm"] == 3.0
    assert math.isnan(out["train/entropy"])


def test_metric_averager_tensor_values_equal_the_per_key_float64_arithmetic():
    """0-dim tensors of one call are summed as one float64 vector per dtype: the same result,
    bit for bit, as each key's own ``Σ w · v / Σ w`` in float64; a key that comes in calls of
    different key sets (or as a float) combines all of them."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for i in range(5):
        w = torch.tensor(float(3 + i))
        stats = {
            "a": torch.rand((), generator=g),
            "b": torch.rand((), generator=g, dtype=torch.float64),
            "c_max": torch.rand((), generator=g),
        }
        if i % 2:
            stats["d"] = torch.randint(0, 10**9, ()) * 7  # int64: not rounded through float32
        calls.append((stats, w))
    avg = MetricAverager()
    for stats, w in calls:
        avg.add(stats, w)
    avg.add({"a": 0.25}, 2.0)  # the same key as a float, and alone
    avg.add({"a": torch.tensor(0.5)}, 1.0)
    out = avg.result()
    for key in ("b", "d"):
        sums, ws = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for stats, w in calls:
            if key in stats:
                sums, ws = sums + stats[key].to(torch.float64) * w.double(), ws + w.double()
        assert out[key] == (sums / ws).item()
    num = sum(float(st["a"]) * float(w) for st, w in calls) + 0.25 * 2.0 + 0.5
    assert out["a"] == pytest.approx(num / (sum(float(w) for _, w in calls) + 3.0), rel=1e-15)
    assert out["c_max"] == max(float(st["c_max"]) for st, _ in calls)


def test_reduce_over_ranks_means_and_extremes():
    ranks = [
        {"rollout/reward_mean": 0.2, "rollout/response_len_max": 7.0, "x_min": 1.0, "only0": 5.0},
        {"rollout/reward_mean": 0.4, "rollout/response_len_max": 3.0, "x_min": -2.0},
    ]
    assert reduce_over_ranks(ranks) == {
        "only0": 5.0,
        "rollout/response_len_max": 7.0,
        "rollout/reward_mean": pytest.approx(0.3),
        "x_min": -2.0,
    }
