"""The training progress bar (tqdm): step, reward, KL and tokens/s at a glance."""

from __future__ import annotations

import math
from collections.abc import Mapping

from tqdm import tqdm

# bar label -> metric names to try, first present wins
BAR_FIELDS: dict[str, tuple[str, ...]] = {
    "reward": ("rollout/reward_mean",),
    "kl": ("train/kl_ref_mean", "train/approx_kl"),
    "tok/s": ("perf/tokens_per_s",),
}


def bar_postfix(metrics: Mapping[str, float]) -> dict[str, str]:
    """The short ``{label: value}`` shown after the bar (labels of BAR_FIELDS)."""
    out = {}
    for label, names in BAR_FIELDS.items():
        for name in names:
            if name in metrics and math.isfinite(float(metrics[name])):
                v = float(metrics[name])
                out[label] = f"{v:.0f}" if label == "tok/s" else f"{v:.3f}"
                break
    return out


class ProgressBar:
    """A tqdm bar over training steps; ``update(metrics)`` after each step.

    Args:
        total: total training steps; initial: the first step (a resumed run).
        enabled: False gives a bar that prints nothing (non-zero ranks, ``progress_bar: false``).
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            disable=not enabled,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )

    def update(self, metrics: Mapping[str, float]) -> None:
        self._bar.set_postfix(bar_postfix(metrics), refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
