"""Plot metrics from a metrics.jsonl (needs matplotlib).

    python -m minippo.training.plot /tmp/minippo/tiny_cpu/metrics.jsonl \\
        --keys rollout/reward_mean --out reward.png
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

from minippo.training.metrics import read_jsonl


def plot_metrics(
    path: str | os.PathLike,
    keys: Sequence[str],
    out: str | os.PathLike,
    *,
    title: str | None = None,
    hline: float | None = None,
) -> None:
    """One line per metric name in ``keys`` against the step; saved as a PNG at ``out``.

    ``hline`` draws a dashed horizontal reference line (e.g. 0.8 x the maximum reward).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    rows = read_jsonl(path)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
        if not pts:
            raise KeyError(f"no finite values of {key!r} in {path}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=key)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=f"{hline:g}")
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Plot metrics of a metrics.jsonl against the step.")
    p.add_argument("jsonl")
    p.add_argument("--keys", nargs="+", default=["rollout/reward_mean"])
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--title", default=None)
    p.add_argument("--hline", type=float, default=None, help="dashed reference line")
    a = p.parse_args(argv)
    plot_metrics(a.jsonl, a.keys, a.out, title=a.title, hline=a.hline)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
