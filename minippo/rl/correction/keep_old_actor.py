"""keep_old_actor: exact old logits from a per-rank snapshot of every live weight version.

The weight plumbing (local shards, the in-place swap, the collectives) lives in ``minippo.parallel``
and is imported inside the methods that use it: ``minippo.parallel`` imports FSDP, distributed
checkpointing and the model package, and the fail-fast contract imports this module (for its
summary) and must stay a pure config check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minippo.config import canonical_dtype, torch_dtype
from minippo.rl.correction.base import STORAGE_DEVICES, Correction, WeightCopies, number, one_of
from minippo.rl.correction.outputs import FixedAnchors
from minippo.rl.correction.weights import discrepancy_weights
from minippo.rl.types import RolloutBatch


class KeepOldActor(Correction):
    """anchor = the exact weights that sampled each token (per-version snapshots); one forward per
    version in the batch + one weight copy per live version.

    Args:
        cap: w_t = clamp(exp(a_t − μ_t), 0, cap), the train-vs-inference discrepancy weight;
            None for w_t = 1.
        storage: "cpu" (pinned when CUDA is available) or "accelerator" (the parameters' device).
        storage_dtype: None (the training dtype: exact anchors) or "bf16" / "fp32" / "fp16".
        plus the arguments of ``Correction``.

    Lifetime: ``on_weights_published(v, actor)`` copies the weights that will sample version v.
    The latest published version is always kept (the engines sample with it); every other version
    is kept until ``retain(versions)`` no longer lists it or ``release_versions_below`` passes it
    (the recipe calls ``retain`` with the versions of the queued and carried tokens after every
    ``prepare`` and publish). Publishing version v releases the versions below
    v − max_staleness, which no later batch may contain (the rollout queue refuses older tokens),
    and so does ``prepare(step=k)`` for k − max_staleness (``step`` is the version the step
    trains from). ``prepare`` scores the whole batch once per distinct version
    present (on any rank) and takes each token's anchor from the forward of its own version; a
    token without a snapshot of its version is an error.

    Memory: when the actor still holds exactly the latest published weights (the recipe's
    order: prepare before the updates; checked by comparing it with the latest snapshot) and the
    snapshots are in the training dtype, the latest version is scored in place and the actor is
    restored from its snapshot after the older versions are scored: no swap buffer (one full
    weight copy less).
    """

    method = "keep_old_actor"

    def __init__(
        self,
        *,
        cap: float | None = 2.0,
        storage: str = "cpu",
        storage_dtype: str | torch.dtype | None = None,
        **provided: Any,
    ):
        super().__init__(cap=cap, storage=storage, storage_dtype=storage_dtype, **provided)
        self.cap = None if cap is None else float(cap)
        self.storage = storage
        self.storage_dtype = (
            torch_dtype(storage_dtype, "correction.storage_dtype")
            if isinstance(storage_dtype, str)
            else storage_dtype
        )
        self._snapshots: dict[int, list[torch.Tensor]] = {}
        self._latest: int | None = None
        self._swap = None  # a minippo.parallel.weight_swap.ParamSwap, made by the first prepare
        # the buffers of the last evicted version, reused by the next publish: in the training
        # loop a version is evicted (prepare) just before the next one is published, so the
        # reuse saves an allocation (and its page faults) per step without raising peak memory
        self._spare: list[torch.Tensor] | None = None

    @classmethod
    def check(cls, **options: Any) -> dict[str, Any]:
        o = super().check(**options)
        if o["cap"] is not None and number(cls, "cap", o["cap"]) < 1:
            raise ValueError(
                f"correction.cap must be >= 1 (a ratio of 1 is on-policy and must keep its "
                f"weight), or null for w = 1; got cap={o['cap']} ({cls.__name__})"
            )
        one_of(cls, "storage", o["storage"], STORAGE_DEVICES)
        if o["storage_dtype"] is not None and not isinstance(o["storage_dtype"], torch.dtype):
            torch_dtype(o["storage_dtype"], "correction.storage_dtype")
        return o

    @classmethod
    def stored_weights(
        cls, *, max_staleness: int, partial_rollout: bool, **options: Any
    ) -> list[WeightCopies]:
        """max_staleness + 1 live snapshots (+ 1 with partial rollouts) on ``storage``, and a swap
        buffer only when the snapshots are in another dtype than the training one (otherwise the
        actor is restored from the latest snapshot, an exact copy, after scoring older ones)."""
        o = cls.check(**options)
        sd = o["storage_dtype"]
        if isinstance(sd, torch.dtype):
            sd = str(sd).removeprefix("torch.")
        dtype = None if sd is None else canonical_dtype(sd, "correction.storage_dtype")
        versions = max_staleness + 1 + (1 if partial_rollout else 0)
        copies = [WeightCopies("snapshots", versions, dtype, o["storage"])]
        if dtype is not None:
            copies.append(WeightCopies("swap buffer", 1, None, o["storage"]))
        return copies

    @classmethod
    def scoring_passes(cls, *, max_staleness: int, **options: Any) -> int:
        """One per version a batch may hold: step − max_staleness … step."""
        return max_staleness + 1

    # ---- snapshot lifetime --------------------------------------------------------------------
    @property
    def live_versions(self) -> list[int]:
        return sorted(self._snapshots)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by the snapshots of this rank (Σ numel × element size over live versions)."""
        return sum(t.numel() * t.element_size() for s in self._snapshots.values() for t in s)

    def _storage_device(self) -> torch.device | None:
        """CPU for "cpu" storage; None (each parameter's own device) for "accelerator"."""
        return torch.device("cpu") if self.storage == "cpu" else None

    def on_weights_published(self, version: int, actor: nn.Module) -> None:
        from minippo.parallel.weight_swap import alloc_like, check_like, local_shards

        if self._latest is not None and version < self._latest:
            raise ValueError(
                f"keep_old_actor: published version {version} is older than the last published "
                f"version {self._latest}; versions must not decrease"
            )
        shards = local_shards(actor)
        if version in self._snapshots:  # re-published (e.g. after a resume): overwrite in place
            snap = self._snapshots[version]
            check_like(f"snapshot of version {version}", snap, shards)
        elif self._spare is not None and [t.shape for t in self._spare] == [
            t.shape for t in shards
        ]:
            snap, self._spare = self._spare, None
        else:
            snap = alloc_like(shards, dtype=self.storage_dtype, device=self._storage_device())
        with torch.no_grad():
            torch._foreach_copy_(snap, shards)
        self._snapshots[version] = snap
        self._latest = version
        # from now on steps train from `version`: no batch holds tokens older than this
        self.release_versions_below(version - self.max_staleness)

    def retain(self, versions: Iterable[int]) -> None:
        """Keep exactly ``versions`` (plus the latest published one); evict every other snapshot.

        Raises if a listed version has no snapshot: a queued token would then miss its anchor.
        """
        keep = {int(v) for v in versions}
        missing = sorted(keep - set(self._snapshots))
        if missing:
            raise ValueError(
                f"keep_old_actor: versions {missing} are still referenced but have no snapshot "
                f"(live: {self.live_versions}); they were evicted or never published"
            )
        for v in list(self._snapshots):
            if v not in keep and v != self._latest:
                self._spare = self._snapshots.pop(v)

    def release_versions_below(self, version: int) -> None:
        """Evict every snapshot older than ``version`` (the latest published one is kept)."""
        self.retain(v for v in self._snapshots if v >= version)

    def _actor_holds_latest(self, actor: nn.Module) -> bool:
        """True when the latest snapshot is a bit-exact copy of the actor's local shards (same
        dtype, same values; compared one tensor at a time, one host sync), so that the actor can
        be restored from it instead of from a swap buffer."""
        from minippo.parallel.distributed import all_reduce_floats
        from minippo.parallel.weight_swap import local_shards

        if self._latest is None:
            return False
        shards, snap = local_shards(actor), self._snapshots[self._latest]
        if any(a.dtype != b.dtype for a, b in zip(shards, snap)):
            return False
        with torch.no_grad():
            differ = [(a != b.to(a.device, non_blocking=True)).any() for a, b in zip(shards, snap)]
        device = shards[0].device if shards else torch.device("cpu")
        local = float(torch.stack(differ).any()) if differ else 0.0
        (ranks_differing,) = all_reduce_floats([local], "max", device)  # one decision for all
        return ranks_differing == 0.0

    # ---- anchors ------------------------------------------------------------------------------
    def compute(self, batch: RolloutBatch, actor: nn.Module, step: int) -> FixedAnchors:
        from minippo.parallel.distributed import all_reduce_floats, union_over_ranks
        from minippo.parallel.weight_swap import ParamSwap, nbytes

        mask, versions = batch.response_mask, batch.versions
        valid = mask > 0
        present = [int(v) for v in torch.unique(versions[valid]).tolist()]
        device = mask.device  # the batch lives on the actor's device (it is scored there)
        # under FSDP every rank must run the same forwards: score the versions of all ranks
        to_score = union_over_ranks(present, device)
        anchor = torch.zeros_like(batch.rollout_logprobs, dtype=torch.float32)
        source = torch.full_like(versions, -1)  # the snapshot version each anchor came from

        def take(v: int) -> None:
            nonlocal anchor, source
            lp = self.score(actor, batch)
            sel = valid & (versions == v)
            anchor = torch.where(sel, lp, anchor)
            source = torch.where(sel, torch.full_like(source, v), source)

        # When the actor still holds the latest version and its snapshot is an exact copy (the
        # training dtype), that version is scored in place and the actor is restored from its
        # snapshot afterwards: no swap buffer (one full copy of the weights) is needed.
        exact = self._actor_holds_latest(actor)
        restore = self._snapshots[self._latest] if exact else None
        if exact and self._latest in to_score:
            take(self._latest)
        older = [v for v in to_score if v in self._snapshots and not (exact and v == self._latest)]
        if older:
            if self._swap is None:
                self._swap = ParamSwap(self._storage_device())
            with self._swap.borrow(actor, restore_from=restore) as load:
                for v in older:
                    load(self._snapshots[v])
                    take(v)
        local_mismatch = int((valid & (source != versions)).sum())
        (mismatches,) = all_reduce_floats([float(local_mismatch)], "sum", device)
        if mismatches:
            missing = sorted(set(present) - set(self._snapshots))
            raise RuntimeError(
                f"keep_old_actor: {int(mismatches)} tokens (this rank: {local_mismatch}) have no "
                f"anchor from a snapshot of their own version (missing on this rank: {missing}; "
                f"live snapshots: {self.live_versions}). A version still referenced by queued "
                "tokens was evicted, or on_weights_published was not called for it."
            )
        # the queue's bound: no later batch holds tokens older than step − max_staleness (its
        # step trains from version `step` or newer); retain() evicts what nothing references
        self.release_versions_below(step - self.max_staleness)
        w = discrepancy_weights(anchor, batch.rollout_logprobs.float(), mask, cap=self.cap)
        out = FixedAnchors.from_weights(batch, anchor, w)
        out.info.update(
            {
                "correction/version_mismatches": float(mismatches),
                "correction/versions_in_batch": float(len(present)),
                "correction/snapshot_versions": float(len(self._snapshots)),
                "correction/snapshot_oldest_version": float(min(self._snapshots, default=-1)),
                "correction/snapshot_bytes": float(self.snapshot_bytes),
                "correction/snapshot_spare_bytes": float(nbytes(self._spare or [])),
                "correction/swap_buffer_bytes": float(self._swap.nbytes if self._swap else 0),
            }
        )
        return out

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Snapshots are saved (per rank, local shards): the queued tokens they serve survive a
        resume only with their exact old weights, which cannot be rebuilt afterwards."""
        return {
            "method": self.method,
            "latest": self._latest,
            "snapshots": {v: list(s) for v, s in self._snapshots.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from minippo.parallel.weight_swap import alloc_like

        super().load_state_dict(state)
        self._snapshots = {}
        self._spare = None
        # "cpu" storage: fresh (pinned) CPU buffers; "accelerator": where the loader put them
        device = self._storage_device()
        for v, tensors in state["snapshots"].items():
            buf = alloc_like(list(tensors), dtype=self.storage_dtype, device=device)
            with torch.no_grad():
                torch._foreach_copy_(buf, list(tensors))
            self._snapshots[int(v)] = buf
        self._latest = state["latest"]
