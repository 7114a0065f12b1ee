"""The interface every correction implements and what it declares about itself.

A correction is a ``Correction`` subclass. It implements ``compute`` (anchors, weights and keep-mask
of one step's batch) and, when it keeps state, the hooks; it validates its own options in the
classmethod ``check``; and it declares, as class attributes and classmethods, what the fail-fast
contract, ``minippo plan`` and the docs need: ``summary``, ``corrects_behaviour_policy``,
``stored_weights`` and ``scoring_passes``. Nothing outside the class compares method names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from minippo.rl.correction.outputs import CorrectionOutput
from minippo.rl.correction.weights import staleness_metrics
from minippo.rl.types import RolloutBatch

ScoreFn = Callable[[nn.Module, RolloutBatch], torch.Tensor]
# Constructor arguments the recipe provides to every correction (not method options).
PROVIDED = ("temperature", "max_staleness", "updates_per_step", "score_fn")
STORAGE_DEVICES = ("cpu", "accelerator")
REQUIRED = inspect.Parameter.empty  # the default of an option without one


@dataclass(frozen=True)
class WeightCopies:
    """Weights a correction stores, in units of the actor's local shards (for ``minippo plan``).

    what:    e.g. "θ̄", "snapshots", "swap buffer".
    copies:  full copies of this rank's local parameter shards, worst case.
    dtype:   a dtype name ("float32", "bfloat16", ...); None = the trainer's master-weight dtype.
    storage: "cpu" (pinned host memory when CUDA is present) or "accelerator".
    """

    what: str
    copies: int
    dtype: str | None
    storage: str


# --------------------------------------------------------------------------------------------
# Option checks shared by the classes' ``check``
# --------------------------------------------------------------------------------------------


def number(owner: type, key: str, value: Any) -> float:
    """``value`` as a float; ValueError naming ``correction.<key>`` when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"correction.{key} must be a number, got {key}={value!r} ({owner.__name__})"
        )
    return float(value)


def one_of(owner: type, key: str, value: Any, choices: Iterable[str]) -> None:
    """ValueError naming ``correction.<key>`` and the choices when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(
            f"correction.{key}={value!r} is not one of {list(choices)} ({owner.__name__})"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# The base class
# --------------------------------------------------------------------------------------------


class Correction:
    """Shared plumbing of every correction: option checks, scoring, staleness metrics, hooks.

    Arguments the recipe provides (``PROVIDED``):
        temperature:      sampling temperature T; anchors are log_softmax(logits / T) like μ
                          (T = 0, greedy, scores at T = 1 like the engine).
        max_staleness:    rollout.max_staleness (EWMA derives β from it).
        updates_per_step: optimizer steps per training step = ppo.epochs × ppo.minibatches
                          (× optimizer steps per minibatch).
        score_fn:         (model, batch) -> Float[B, R] response logprobs; default
                          ``minippo.models.response_logprobs`` at ``temperature``.
    ``options``: a subclass's own options, passed up so that construction runs ``check`` once on
    all of them (``super().__init__(cap=cap, **provided)``).

    What a subclass declares:
        summary:                   one line for the fail-fast message and the docs (default:
                                   the first paragraph of the class docstring).
        corrects_behaviour_policy: False only for a method that anchors to the current weights
                                   (``NoCorrection``); the contract refuses such a class for async
                                   PPO with a critic.
        method:                    a short name for metrics and checkpoints (default: the class
                                   name); nothing branches on it.
        stored_weights(...), scoring_passes(...): its memory and compute per step, worst case.
    Under torch.distributed ``prepare`` is collective (every rank calls it).
    """

    method: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    corrects_behaviour_policy: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "summary" not in cls.__dict__:
            paragraph = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
            cls.summary = " ".join(paragraph.split())
        if "method" not in cls.__dict__:
            cls.method = cls.__name__

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        max_staleness: int = 0,
        updates_per_step: int = 1,
        score_fn: ScoreFn | None = None,
        **options: Any,
    ):
        self.check(
            temperature=temperature,
            max_staleness=max_staleness,
            updates_per_step=updates_per_step,
            score_fn=score_fn,
            **options,
        )
        self.temperature = temperature
        self.max_staleness = max_staleness
        self.updates_per_step = updates_per_step
        if score_fn is None:
            # imported on use: the fail-fast contract imports this package but not the models
            from minippo.models import response_logprobs

            score_fn = partial(response_logprobs, temperature=temperature or 1.0)
        self.score_fn: ScoreFn = score_fn
        self._forwards = 0

    # ---- what the class declares ------------------------------------------------------------
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every keyword argument of the constructor with its default (``REQUIRED`` if none),
        read from the ``__init__`` signatures along the class hierarchy."""
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            init = klass.__dict__.get("__init__")
            if init is None or not issubclass(klass, Correction):
                continue
            for p in inspect.signature(init).parameters.values():
                if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                    out[p.name] = p.default
        return out

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        """Raise ValueError, naming the key and the fix, when ``options`` are unknown, missing or
        out of range; return them with the constructor's defaults filled in.

        ``options``: any subset of the constructor's keyword arguments (a YAML node's keys, or
        everything the constructor got). The constructor and the fail-fast contract both call it.
        Subclasses extend it: ``o = super().check(**options)``, check their keys in ``o``,
        ``return o``.
        """
        accepted = cls.defaults()
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            own = [k for k in accepted if k not in PROVIDED]
            given = ", ".join(f"{k}={options[k]!r}" for k in unknown)
            raise ValueError(
                f"correction {cls.__name__} does not take {given}; its options are {own or 'none'}"
            )
        o = {**accepted, **options}
        missing = [k for k, v in o.items() if v is REQUIRED]
        if missing:
            raise ValueError(
                f"correction {cls.__name__} needs {', '.join(missing)}; set "
                + ", ".join(f"correction.{k}" for k in missing)
            )
        if number(cls, "temperature", o["temperature"]) < 0:
            raise ValueError(f"correction.temperature must be >= 0, got {o['temperature']}")
        if not _is_int(o["max_staleness"]) or o["max_staleness"] < 0:
            raise ValueError(
                f"correction.max_staleness must be an int >= 0, got {o['max_staleness']!r}"
            )
        if not _is_int(o["updates_per_step"]) or o["updates_per_step"] < 1:
            raise ValueError(
                "correction.updates_per_step must be an int >= 1 (ppo.epochs × ppo.minibatches),"
                f" got {o['updates_per_step']!r}"
            )
        if o["score_fn"] is not None and not callable(o["score_fn"]):
            raise ValueError(f"score_fn must be callable or None, got {o['score_fn']!r}")
        return o

    @classmethod
    def stored_weights(
        cls, *, max_staleness: int, partial_rollout: bool, **options: Any
    ) -> list[WeightCopies]:
        """The weight copies the method keeps, worst case (``options``: the config's keys)."""
        raise NotImplementedError(
            f"{cls.__name__} must declare stored_weights(*, max_staleness, partial_rollout, "
            "**options) -> list[WeightCopies] (an empty list when it stores no weights)"
        )

    @classmethod
    def scoring_passes(cls, *, max_staleness: int, **options: Any) -> int:
        """Extra no-grad forward passes of the actor per step, worst case."""
        raise NotImplementedError(
            f"{cls.__name__} must declare scoring_passes(*, max_staleness, **options) -> int"
        )

    # ---- the step ---------------------------------------------------------------------------
    def prepare(self, batch: RolloutBatch, actor: nn.Module, *, step: int) -> CorrectionOutput:
        """Anchors, weights, keep-mask and metrics of ``batch`` at the start of step ``step``.

        Call once per step, before the first optimizer update; every epoch and minibatch of the
        step then uses the returned output.
        """
        _check_batch(batch, step)
        self._forwards = 0
        out = self.compute(batch, actor, step)
        out.info.update(staleness_metrics(batch.versions, batch.response_mask, step))
        out.info["correction/forward_passes"] = float(self._forwards)
        return out

    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> CorrectionOutput:
        """What a method implements: the output of ``prepare`` (its own metrics in ``info``)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement compute(batch, actor, step)"
        )

    def score(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """One no-grad forward with ``score_fn`` (counted in ``correction/forward_passes``):
        Float32[B, R] logprobs of the response tokens."""
        with torch.no_grad():
            lp = self.score_fn(model, batch)
        self._forwards += 1
        if lp.shape != batch.response_mask.shape:
            raise ValueError(
                f"score_fn returned shape {tuple(lp.shape)}, expected [B, R] = "
                f"{tuple(batch.response_mask.shape)}"
            )
        return lp.detach().float()

    # ---- hooks (no-ops unless a method keeps state) -----------------------------------------
    def after_optimizer_step(self, actor: nn.Module) -> None:
        """Called after every optimizer step of the actor."""

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        """Called when ``actor``'s current weights are published as ``version`` (0: initial)."""

    def retain(self, versions: Iterable[int]) -> None:
        """The weight versions still referenced by queued or in-flight tokens."""

    def release_versions_below(self, version: int) -> None:
        """No token older than ``version`` will be trained on any more."""

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state to checkpoint (tensors are this rank's local shards)."""
        return {"method": self.method}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(
                f"checkpoint holds correction state of method {state.get('method')!r}, but this "
                f"run's correction is {self.method!r}; set correction._component_ to match or "
                "start without the correction state"
            )


def _check_batch(batch: RolloutBatch, step: int) -> None:
    valid = batch.response_mask > 0
    if batch.rollout_logprobs.shape != batch.response_mask.shape or (
        batch.versions.shape != batch.response_mask.shape
    ):
        raise ValueError(
            f"rollout_logprobs {tuple(batch.rollout_logprobs.shape)} and versions "
            f"{tuple(batch.versions.shape)} must be response-aligned like response_mask "
            f"{tuple(batch.response_mask.shape)}"
        )
    if valid.any():
        v = batch.versions[valid]
        lo, hi = int(v.min()), int(v.max())
        if lo < 0 or hi > step:
            raise ValueError(
                f"token versions must lie in [0, step={step}] (version k is what the actor holds "
                f"at the start of step k), got versions in [{lo}, {hi}]"
            )
