"""ewma: PPO-EWMA with reset, anchors from θ̄, a bias-corrected moving average of the weights.

The weight plumbing (local shards, the in-place swap, the collectives) lives in ``minippo.parallel``
and is imported inside the methods that use it: ``minippo.parallel`` imports FSDP, distributed
checkpointing and the model package, and the fail-fast contract imports this module (for its
summary) and must stay a pure config check.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minippo.rl.correction.base import STORAGE_DEVICES, Correction, WeightCopies, number, one_of
from minippo.rl.correction.outputs import FixedAnchors
from minippo.rl.correction.weights import symmetric_mask_weights
from minippo.rl.types import RolloutBatch


class EWMA(Correction):
    """anchor = a moving average of the weights (PPO-EWMA) with a train/inference mask and reset;
    one fp32 weight copy + one forward per step (two on a reset step).

    Args:
        beta: EWMA decay; default β = s / (1 + s), s = max_staleness × updates_per_step / 2 (the
            average's mean age β/(1−β) is then half the largest data age in optimizer steps).
            With s = 0 (synchronous) β = 0: θ̄ is the current weights.
        cap: c of the symmetric train-inference mask [1/c, c] (> 1).
        reset_below: reset θ̄ to the current weights when the retained fraction falls below this.
        reset_guard: reset only when the current weights retain more of this batch than θ̄ did
            (opt-in; the seed's rule, the default, resets whenever θ̄ retains too little). When
            batches sit at the staleness bound θ̄ is older than the actor but closer to the data,
            and a reset then moves the reference away from the data and triggers the next reset
            (docs/corrections.md, "The reset trap"). A reset step scores the actor anyway, so the
            guard costs nothing more.
        swap_storage: where the buffer that saves the actor's weights while θ̄ is swapped in
            lives: "accelerator" (the parameters' device: two device-local copies per swap) or
            "cpu" (pinned when CUDA is available: saves one training-dtype copy of the local
            shards on the accelerator, the swap then crosses the host link twice).
        plus the arguments of ``Correction``.

    θ̄ is fp32 local shards on the parameters' device, updated after every optimizer step by
        n ← β·n + 1 (n starts at 1),   θ̄ ← θ̄·(β·n_prev/n) + θ/n = lerp(θ̄, θ, 1/n)
    (β·n_prev/n = 1 − 1/n, so the update is one fused ``_foreach_lerp_``).
    """

    method = "ewma"

    def __init__(
        self,
        *,
        beta: float | None = None,
        cap: float = 2.0,
        reset_below: float = 0.8,
        reset_guard: bool = False,
        swap_storage: str = "accelerator",
        **provided: Any,
    ):
        super().__init__(
            beta=beta,
            cap=cap,
            reset_below=reset_below,
            reset_guard=reset_guard,
            swap_storage=swap_storage,
            **provided,
        )
        s = self.max_staleness * self.updates_per_step / 2
        self.beta = float(beta) if beta is not None else s / (1 + s)
        self.cap = float(cap)
        self.reset_below = float(reset_below)
        self.reset_guard = bool(reset_guard)
        self.swap_storage = swap_storage
        self.n = 1.0
        self.resets = 0
        self.resets_refused = 0  # by the reset guard
        self.theta_bar: list[torch.Tensor] | None = None
        self._swap = None  # a minippo.parallel.weight_swap.ParamSwap, made on first use

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        o = super().check(**options)
        if number(cls, "cap", o["cap"]) <= 1:
            raise ValueError(
                "correction.cap (c) must be > 1 so that the mask [1/c, c] keeps ρ = 1, got "
                f"cap={o['cap']} ({cls.__name__})"
            )
        if o["beta"] is not None and not 0 < number(cls, "beta", o["beta"]) < 1:
            raise ValueError(
                f"correction.beta must be in (0, 1), got beta={o['beta']} ({cls.__name__})"
            )
        if not 0 < number(cls, "reset_below", o["reset_below"]) < 1:
            raise ValueError(
                f"correction.reset_below must be in (0, 1), got reset_below={o['reset_below']} "
                f"({cls.__name__})"
            )
        one_of(cls, "swap_storage", o["swap_storage"], STORAGE_DEVICES)
        one_of(cls, "reset_guard", o["reset_guard"], (True, False))
        return o

    @classmethod
    def stored_weights(
        cls, *, max_staleness: int, partial_rollout: bool, **options: Any
    ) -> list[WeightCopies]:
        """fp32 θ̄ on the accelerator and the swap buffer on ``swap_storage``."""
        o = cls.check(**options)
        return [
            WeightCopies("θ̄", 1, "float32", "accelerator"),
            WeightCopies("swap buffer", 1, None, o["swap_storage"]),
        ]

    @classmethod
    def scoring_passes(cls, *, max_staleness: int, **options: Any) -> int:
        """θ̄'s forward, plus the recomputation with the reset θ̄ on a reset step."""
        return 2

    # ---- θ̄ ------------------------------------------------------------------------------------
    def _reset(self, actor: nn.Module) -> None:
        """θ̄ ← θ (fp32), n ← 1."""
        from minippo.parallel.weight_swap import alloc_like, check_like, local_shards

        shards = local_shards(actor)
        if self.theta_bar is None:
            self.theta_bar = alloc_like(shards, dtype=torch.float32, device=None)
        check_like("EWMA θ̄", self.theta_bar, shards)
        with torch.no_grad():
            torch._foreach_copy_(self.theta_bar, shards)
        self.n = 1.0

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        if self.theta_bar is None:
            self._reset(actor)

    def after_optimizer_step(self, actor: nn.Module) -> None:
        from minippo.parallel.weight_swap import local_shards

        if self.theta_bar is None:
            raise RuntimeError(
                "ewma: θ̄ is not initialised; call on_weights_published(0, actor) or prepare() "
                "before the first optimizer step"
            )
        shards = local_shards(actor)
        n_prev = self.n
        self.n = self.beta * n_prev + 1.0  # n ← β·n + 1
        with torch.no_grad():
            # θ̄ ← θ̄·(β·n_prev/n) + θ/n  ≡  θ̄ + (θ − θ̄)/n
            if all(s.dtype == torch.float32 for s in shards):
                torch._foreach_lerp_(self.theta_bar, shards, 1.0 / self.n)
            else:
                torch._foreach_mul_(self.theta_bar, self.beta * n_prev / self.n)
                torch._foreach_add_(self.theta_bar, shards, alpha=1.0 / self.n)

    def distance(self, actor: nn.Module) -> float:
        """‖θ̄ − θ‖₂ over the whole model (all ranks' shards)."""
        from minippo.parallel.distributed import all_reduce_floats
        from minippo.parallel.weight_swap import local_shards, sharded_flags

        shards = local_shards(actor)
        device = shards[0].device if shards else torch.device("cpu")
        # Σ‖θ̄ − θ‖² of the sharded (summed over ranks) and the replicated (counted once)
        # parameters, accumulated in fp64 on the device
        sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
        with torch.no_grad():
            for tb, t, sharded in zip(self.theta_bar, shards, sharded_flags(actor)):
                # one tensor-sized fp32 temporary at a time
                sq[0 if sharded else 1] += torch.linalg.vector_norm(tb - t.float()).double() ** 2
        local_sharded, replicated = torch.stack(sq).tolist()
        (sharded_sum,) = all_reduce_floats([local_sharded], "sum", device)
        return math.sqrt(sharded_sum + replicated)

    # ---- anchors ------------------------------------------------------------------------------
    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> FixedAnchors:
        from minippo.parallel.weight_swap import ParamSwap, nbytes

        if self.theta_bar is None:
            self._reset(actor)
        if self._swap is None:
            self._swap = ParamSwap(torch.device("cpu") if self.swap_storage == "cpu" else None)
        mu, mask = batch.rollout_logprobs.float(), batch.response_mask
        with self._swap.borrow(actor) as load:
            load(self.theta_bar)
            anchor = self.score(actor, batch)
        w = symmetric_mask_weights(anchor, mu, mask, cap=self.cap)
        retained = self._retained(w, mask)
        reset = False
        if retained < self.reset_below:
            # the candidate reference: the current weights (θ̄ after a reset, n ← 1)
            actor_anchor = self.score(actor, batch)
            actor_w = symmetric_mask_weights(actor_anchor, mu, mask, cap=self.cap)
            reset = not self.reset_guard or self._retained(actor_w, mask) > retained
            if reset:
                self._reset(actor)
                self.resets += 1
                anchor, w = actor_anchor, actor_w
            else:
                self.resets_refused += 1
        out = FixedAnchors.from_weights(batch, anchor, w, "masked")
        out.info.update(
            {
                "correction/ewma_beta": self.beta,
                "correction/ewma_n": self.n,
                "correction/ewma_resets": float(self.resets),
                "correction/ewma_reset_this_step": float(reset),
                "correction/ewma_retained_before_reset": retained,
                "correction/ewma_resets_refused": float(self.resets_refused),
                "correction/ewma_distance": self.distance(actor),
                "correction/ewma_bytes": float(nbytes(self.theta_bar)),
                "correction/swap_buffer_bytes": float(self._swap.nbytes),
            }
        )
        return out

    @staticmethod
    def _retained(w: Any, mask: torch.Tensor) -> float:
        """Kept fraction Σ m·k / Σ m over all ranks: the reset decision is global, because every
        rank's θ̄ shard must stay one model (one host sync)."""
        from minippo.parallel.distributed import all_reduce_floats

        kept, total = all_reduce_floats(
            torch.stack([(w.keep * mask).sum(), mask.sum()]).tolist(), "sum", mask.device
        )
        return kept / total if total else 1.0

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "beta": self.beta,
            "n": self.n,
            "resets": self.resets,
            "resets_refused": self.resets_refused,
            "theta_bar": None if self.theta_bar is None else list(self.theta_bar),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not math.isclose(state["beta"], self.beta, rel_tol=0, abs_tol=1e-12):
            raise ValueError(
                f"ewma: the checkpoint was made with beta={state['beta']} but this run has "
                f"beta={self.beta}; set correction.beta={state['beta']} (or the same max_staleness "
                "and updates_per_step) to resume"
            )
        self.n = float(state["n"])
        self.resets = int(state["resets"])
        self.resets_refused = int(state.get("resets_refused", 0))
        tb = state["theta_bar"]
        self.theta_bar = None if tb is None else [t.detach().to(torch.float32).clone() for t in tb]
