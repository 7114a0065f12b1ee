"""What a resumed run may change: a checkpoint records the resolved config it trained with, and a
resume that changes anything else is refused before any work, in one line naming the keys.

A checkpoint holds the weights, optimizer states, queue and correction state of one algorithm,
model, correction, optimizer and batch shape; continuing it under another advantage estimator,
correction or batch shape would silently mix two runs in one record. What may change is how
and where the run continues, not what it trains: the keys below (a key also covers its children).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# what a resume may change (docs/recipe.md, "What a resume may change")
MAY_CHANGE_ON_RESUME: tuple[str, ...] = (
    "total_steps",  # continue past the end (the LR schedule's length follows it)
    "lr_scheduler.total_steps",
    "resume_from",
    "output_dir",  # and every path under it
    "overwrite_output_dir",
    "checkpoint.dir",
    "checkpoint.every_n_steps",
    "checkpoint.keep_last",
    "checkpoint.export_hf",
    "metric_logger",
    "log_every_n_steps",
    "progress_bar",
    "eval",  # validation: its cadence and its prompts
    "cpu_threads",
    "engine",  # how rollouts are generated: the correction accounts for the sampling policy
    "publish_bucket_mb",
    "parallel",  # layout and process-group settings (a layout the checkpoint cannot load is
    # refused by the checkpoint check)
    "rollout.offload_trainer",
    "ppo.micro_batch_size",  # how a minibatch is split into forwards (the same update)
    "ppo.score_micro_batch_size",
    "ppo.max_tokens_per_micro_batch",
    "ppo.score_max_tokens_per_micro_batch",
    "activation_checkpointing",
    "compile",
    "max_consecutive_nonfinite",
)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested mapping (lists are leaves)."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE_ON_RESUME)


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: saved -> now`` for every setting that differs between the resolved config a
    checkpoint trained with and this run's, outside :data:`MAY_CHANGE_ON_RESUME`; sorted."""
    a, b = _flat(saved), _flat(now)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, missing), b.get(key, missing)
        if x != y and not _may_change(key):
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{key}: {show(x)} -> {show(y)}")
    return out
