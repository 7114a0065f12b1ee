"""The fail-fast contract on a run config, and building the configured correction.

Both read the correction class named by ``correction._component_`` (any importable ``Correction``
subclass, also a user's own) and ask the class: its ``check`` validates the options, its
``corrects_behaviour_policy`` decides whether an async run with a critic may use it, and its
``summary`` writes the suggestions of the error message.
"""

from __future__ import annotations

import warnings
from typing import Any

from omegaconf import DictConfig, OmegaConf

from minippo.config import instantiate, locate
from minippo.rl.advantages import ADVANTAGE_ESTIMATORS
from minippo.rl.correction.base import Correction, ScoreFn
from minippo.rl.correction.ewma import EWMA
from minippo.rl.correction.keep_old_actor import KeepOldActor
from minippo.rl.correction.simple import TIS, NoCorrection, RolloutLogprobs

PACKAGE = "minippo.rl.correction"
# What the error message for an uncorrected async run with a critic suggests: the four
# corrections of the spec (docs/corrections.md). Any class with corrects_behaviour_policy passes.
SUGGESTED = (RolloutLogprobs, TIS, KeepOldActor, EWMA)
# Keys of the correction node that the recipe provides itself, and where it takes them from.
FROM_THE_RECIPE = {
    "temperature": "rollout.temperature",
    "updates_per_step": "ppo.epochs × ppo.minibatches",
    "score_fn": "the recipe's scoring pass",
}


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def correction_class(component: str) -> type[Correction]:
    """The ``Correction`` subclass a ``_component_`` dotpath names, e.g.
    ``minippo.rl.correction.EWMA`` or a user's ``my_corrections.MyCorrection``."""
    cls = locate(component, "correction._component_")  # a ConfigError (ValueError) names the key
    if not (isinstance(cls, type) and issubclass(cls, Correction)):
        raise ValueError(
            f"correction._component_={component} is not a subclass of {PACKAGE}.Correction; "
            f"subclass it (docs/corrections.md, 'Writing your own correction')"
        )
    return cls


def correction_node(cfg: Any) -> tuple[type[Correction], dict[str, Any]]:
    """(class, options) of ``cfg.correction``; absent or null means ``NoCorrection``."""
    node = _select(cfg, "correction")
    if node is None:
        return NoCorrection, {}
    if not isinstance(node, DictConfig):
        raise ValueError(
            f"correction must be a mapping with a _component_ key, got {node!r}; e.g. "
            f"correction: {{_component_: {PACKAGE}.EWMA}}"
        )
    options = OmegaConf.to_container(node, resolve=True)
    component = options.pop("_component_", None)
    if component is None:
        raise ValueError(
            f"correction has no _component_ key (got keys {sorted(options)}); set e.g. "
            f"correction._component_={PACKAGE}.EWMA"
        )
    return correction_class(component), options


def _fix_message(reason: str) -> str:
    lines = [
        reason,
        "Set one of these in the config (YAML, or the same key=value on the command line):",
    ]
    for cls in SUGGESTED:
        lines.append(f"  correction._component_={PACKAGE}.{cls.__name__}")
        lines.append(f"      {cls.method}: {cls.summary}")
    lines.append(
        f"e.g. in YAML:  correction: {{_component_: {PACKAGE}.KeepOldActor}}. "
        "See docs/corrections.md."
    )
    return "\n".join(lines)


def validate_async_off_policy_correction(cfg: Any) -> str:
    """Fail fast on an async PPO run without a behaviour-policy correction. Returns the class's
    ``method`` name.

    Pure config check (no process group, model or engine); the recipe calls it first. Reads
    ``rollout.max_staleness`` (required int), ``rollout.partial_rollout`` (bool, default false),
    ``advantage_estimator`` (required; an estimator that trains a critic per
    ``ADVANTAGE_ESTIMATORS``, any other value counts as critic-free) and ``correction`` (a
    ``_component_`` node; absent or null means ``NoCorrection``).

    Raises ValueError when the run is async (max_staleness ≥ 1 or partial rollouts) and uses a
    critic but its correction class has ``corrects_behaviour_policy = False``, and for options
    the class's ``check`` refuses. Warns (UserWarning) for a critic-free async run with such a
    class.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    max_staleness = _select(cfg, "rollout.max_staleness")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"rollout.max_staleness must be an int >= 0 (0 = synchronous), got {max_staleness!r}"
        )
    partial_rollout = _select(cfg, "rollout.partial_rollout", default=False)
    if not isinstance(partial_rollout, bool):
        raise ValueError(f"rollout.partial_rollout must be true or false, got {partial_rollout!r}")
    estimator = _select(cfg, "advantage_estimator")
    if not isinstance(estimator, str):
        raise ValueError(
            f'advantage_estimator must be set ("gae" with a critic, "grpo" critic-free), got '
            f"{estimator!r}"
        )
    uses_critic = ADVANTAGE_ESTIMATORS.get(estimator, False)
    is_async = max_staleness >= 1 or partial_rollout

    cls, options = correction_node(cfg)
    for key, source in FROM_THE_RECIPE.items():
        if key in options:
            raise ValueError(
                f"correction.{key} is set by the recipe (from {source}); drop correction.{key}"
            )
    if "max_staleness" in options and options["max_staleness"] != max_staleness:
        raise ValueError(
            f"correction.max_staleness ({options['max_staleness']}) contradicts "
            f"rollout.max_staleness ({max_staleness}); drop correction.max_staleness"
        )
    cls.check(**options)

    if is_async and not cls.corrects_behaviour_policy:
        why = (
            f"rollout.max_staleness={max_staleness}, rollout.partial_rollout={partial_rollout}: "
            "tokens can come from older weights than the trainer's"
        )
        if uses_critic:
            raise ValueError(
                _fix_message(
                    f"Async PPO with a critic (advantage_estimator={estimator}; {why}) needs an "
                    f"explicit behaviour-policy correction, but correction is '{cls.method}' "
                    "(the anchor would be recomputed with weights that never generated the data)."
                )
            )
        warnings.warn(
            f"Critic-free async run (advantage_estimator={estimator}; {why}) with correction "
            f"'{cls.method}': the PPO anchor is the current weights, not the policy that sampled "
            f"the tokens. Consider correction._component_={PACKAGE}.KeepOldActor or "
            f"{PACKAGE}.EWMA (docs/corrections.md).",
            UserWarning,
            stacklevel=2,
        )
    return cls.method


def build_correction(
    cfg: Any, *, temperature: float, updates_per_step: int, score_fn: ScoreFn | None = None
) -> Correction:
    """``instantiate(cfg.correction, **provided)``, with what the recipe provides:
    ``temperature``, ``max_staleness`` (``cfg.rollout.max_staleness``), ``updates_per_step``
    (ppo.epochs × ppo.minibatches × optimizer steps per minibatch) and ``score_fn``. An absent or
    null ``correction`` builds ``NoCorrection``.
    """
    provided = {
        "temperature": temperature,
        "max_staleness": int(_select(cfg, "rollout.max_staleness", default=0)),
        "updates_per_step": updates_per_step,
        "score_fn": score_fn,
    }
    node = _select(cfg, "correction")
    if node is None:
        return NoCorrection(**provided)
    return instantiate(node, **provided)
