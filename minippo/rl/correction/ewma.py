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

from minippo.config import canonical_dtype, torch_dtype
from minippo.rl.correction.base import STORAGE_DEVICES, Correction, WeightCopies, number, one_of
from minippo.rl.correction.outputs import FixedAnchors
from minippo.rl.correction.weights import symmetric_mask_weights
from minippo.rl.types import RolloutBatch

THETA_DTYPES = ("float32", "fp32", "bfloat16", "bf16")
UPDATE_CHUNK = 1 << 22  # elements per fp32 chunk of a bf16 θ̄ update (16 MiB of fp32)


def lerp_stochastic_bf16_(dst: torch.Tensor, src: torch.Tensor, weight: float, seed: int) -> None:
    """dst ← SR_bf16(dst + weight·(src − dst)), in place, for a bf16 ``dst``.

    The lerp is computed in fp32, ``UPDATE_CHUNK`` elements at a time; SR rounds each fp32 value x
    to one of its two bf16 neighbours with probabilities proportional to closeness (add uniform
    random bits below bf16's 16 dropped mantissa bits, then truncate), so E[SR(x)] = x: the average
    drifts toward θ at the right rate however small weight·(src − dst) is. Deterministic given
    ``seed`` (a generator on dst's device per call).
    """
    gen = torch.Generator(device=dst.device).manual_seed(seed % (1 << 62))
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    for i in range(0, flat_dst.numel(), UPDATE_CHUNK):
        d, t = flat_dst[i : i + UPDATE_CHUNK], flat_src[i : i + UPDATE_CHUNK]
        x = d.float().lerp_(t.float(), weight)
        noise = torch.randint(
            0, 1 << 16, x.shape, generator=gen, device=x.device, dtype=torch.int32
        )
        bits = (x.view(torch.int32) + noise) & ~0xFFFF  # truncation after the noise: SR
        rounded = torch.where(torch.isfinite(x), bits.view(torch.float32), x)
        d.copy_(rounded)  # exact: the low 16 bits are zero


def _rank() -> int:
    import torch.distributed as dist  # the rank seeds this rank's rounding noise

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# EWMA.distance: elements of θ̄ − θ formed at a time (256 MiB of fp32)
_DISTANCE_GROUP_NUMEL = 64 * 2**20


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
        theta_dtype: "float32" (default) or "bfloat16" (or "fp32" / "bf16"): the dtype θ̄ is kept
            in. bf16 halves θ̄'s memory; each update is then computed in fp32, one chunk of
            ``UPDATE_CHUNK`` elements at a time, and rounded stochastically to bf16 (unbiased), so
            the average keeps moving when an update is smaller than bf16's resolution, where
            round-to-nearest would leave it unchanged forever.
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
        theta_dtype: str = "float32",
        swap_storage: str = "accelerator",
        **provided: Any,
    ):
        super().__init__(
            beta=beta,
            cap=cap,
            reset_below=reset_below,
            reset_guard=reset_guard,
            theta_dtype=theta_dtype,
            swap_storage=swap_storage,
            **provided,
        )
        s = self.max_staleness * self.updates_per_step / 2
        self.beta = float(beta) if beta is not None else s / (1 + s)
        self.cap = float(cap)
        self.reset_below = float(reset_below)
        self.reset_guard = bool(reset_guard)
        self.theta_dtype = torch_dtype(theta_dtype, "correction.theta_dtype")
        self.updates = 0  # θ̄ updates so far: seeds each stochastic rounding
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
        one_of(cls, "theta_dtype", o["theta_dtype"], THETA_DTYPES)
        return o

    @classmethod
    def stored_weights(
        cls, *, max_staleness: int, partial_rollout: bool, **options: Any
    ) -> list[WeightCopies]:
        """fp32 θ̄ on the accelerator and the swap buffer on ``swap_storage``."""
        o = cls.check(**options)
        return [
            WeightCopies("θ̄", 1, canonical_dtype(o["theta_dtype"]), "accelerator"),
            WeightCopies("swap buffer", 1, None, o["swap_storage"]),
        ]

    @classmethod
    def scoring_passes(cls, *, max_staleness: int, **options: Any) -> int:
        """θ̄'s forward, plus the recomputation with the reset θ̄ on a reset step."""
        return 2

    # ---- θ̄ ------------------------------------------------------------------------------------
    def _reset(self, actor: nn.Module) -> None:
        """θ̄ ← θ (in ``theta_dtype``), n ← 1."""
        from minippo.parallel.weight_swap import alloc_like, check_like, local_shards

        shards = local_shards(actor)
        if self.theta_bar is None:
            self.theta_bar = alloc_like(shards, dtype=self.theta_dtype, device=None)
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
        self.updates += 1
        with torch.no_grad():
            # θ̄ ← θ̄·(β·n_prev/n) + θ/n  ≡  θ̄ + (θ − θ̄)/n
            if self.theta_dtype == torch.bfloat16:
                seed = self.updates * 1_000_003 + _rank()
                for tb, t in zip(self.theta_bar, shards):
                    lerp_stochastic_bf16_(tb, t, 1.0 / self.n, seed)
            elif all(s.dtype == torch.float32 for s in shards):
                torch._foreach_lerp_(self.theta_bar, shards, 1.0 / self.n)
            else:
                torch._foreach_mul_(self.theta_bar, self.beta * n_prev / self.n)
                torch._foreach_add_(self.theta_bar, shards, alpha=1.0 / self.n)

    def distance(self, actor: nn.Module) -> float:
        """‖θ̄ − θ‖₂ over the whole model (all ranks' shards)."""
        from minippo.parallel.distributed import all_reduce_floats
        from minippo.parallel.mesh import replicas
        from minippo.parallel.weight_swap import local_shards, sharded_flags

        shards = local_shards(actor)
        device = shards[0].device if shards else torch.device("cpu")
        # Σ‖θ̄ − θ‖² of the sharded (summed over ranks) and the replicated (counted once)
        # parameters, accumulated in fp64 on the device; under HSDP a shard is on `nnodes` ranks
        copies = [replicas(p) for p in actor.parameters()]
        flags = sharded_flags(actor)
        if shards and all(t.dtype == torch.float32 for t in [*self.theta_bar, *shards]):
            # ‖θ̄ − θ‖ per tensor by foreach calls over groups of tensors (fp32 temporaries of at
            # most _DISTANCE_GROUP_NUMEL elements at a time) and one host copy; the sums below
            # then add the same float64 terms in the same order as the per-tensor loop
            norms, group, numel = [], [], 0
            with torch.no_grad():
                for i, t in enumerate(shards):
                    group.append(i)
                    numel += t.numel()
                    if numel >= _DISTANCE_GROUP_NUMEL or i == len(shards) - 1:
                        diffs = torch._foreach_sub(
                            [self.theta_bar[j] for j in group], [shards[j] for j in group]
                        )
                        norms += torch._foreach_norm(diffs)
                        group, numel = [], 0
            sums = [0.0, 0.0]
            for d, sharded, n in zip(torch.stack(norms).double().tolist(), flags, copies):
                sums[0 if sharded else 1] += d * d / n
            local_sharded, replicated = sums
        else:
            sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
            with torch.no_grad():
                for tb, t, sharded, n in zip(self.theta_bar, shards, flags, copies):
                    # one tensor-sized fp32 temporary at a time
                    d2 = torch.linalg.vector_norm(tb - t.float()).double() ** 2
                    sq[0 if sharded else 1] += d2 / n
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
            "updates": self.updates,
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
        self.updates = int(state.get("updates", 0))
        tb = state["theta_bar"]
        self.theta_bar = (
            None if tb is None else [t.detach().to(self.theta_dtype).clone() for t in tb]
        )
