"""Other weights in a model's parameters, in place: the rank-local shards, copies of them, a swap.

The corrections that score with weights the actor no longer holds (EWMA's average θ̄,
keep_old_actor's per-version snapshots) keep copies of this rank's local parameter shards only
(``p.to_local()`` for FSDP2 DTensor parameters) and never build a second model: to score with other
weights, ``ParamSwap.borrow`` saves the actor's shards into a reusable buffer, copies the other
weights into the parameters' storage, and copies the saved shards back on exit (also on error).

FSDP2 keeps the root's parameters unsharded after a forward without backward; a write into the local
shards would then be shadowed by that stale unsharded copy, so every FSDP module is resharded before
local shards are read or written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minippo.parallel.fsdp import reshard_all

__all__ = [
    "ParamSwap",
    "PublishedWeights",
    "alloc_like",
    "check_like",
    "local_shards",
    "nbytes",
    "sharded_flags",
]


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """The rank-local data of every parameter, in ``model.parameters()`` order (tied ones once).

    FSDP2 parameters are DTensors: their local shard (``to_local()``) shares storage with the
    parameter, so an in-place copy into it changes the model. Plain tensors are returned as is.
    """
    reshard_all(model)  # the local shards are only meaningful in the sharded state
    out = []
    with torch.no_grad():
        for p in model.parameters():
            t = p.detach()
            out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out


def sharded_flags(model: nn.Module) -> list[bool]:
    """Per parameter (``parameters()`` order): True when it is sharded over the ranks (a DTensor),
    False when every rank holds all of it."""
    return [isinstance(p, DTensor) for p in model.parameters()]


def alloc_like(
    tensors: list[torch.Tensor], *, dtype: torch.dtype | None, device: torch.device | None
) -> list[torch.Tensor]:
    """Empty contiguous tensors shaped like ``tensors`` (``dtype``/``device`` None: each tensor's
    own); pinned when on CPU and CUDA is present, so that copies to and from the GPU are async."""
    out = []
    for t in tensors:
        dev = t.device if device is None else device
        pin = dev.type == "cpu" and torch.cuda.is_available()
        out.append(torch.empty(t.shape, dtype=dtype or t.dtype, device=dev, pin_memory=pin))
    return out


def check_like(name: str, stored: list[torch.Tensor], shards: list[torch.Tensor]) -> None:
    """Raise ValueError when ``stored`` does not match ``shards`` tensor for tensor in shape."""
    if len(stored) != len(shards) or any(a.shape != b.shape for a, b in zip(stored, shards)):
        raise ValueError(
            f"{name} holds {len(stored)} tensors that do not match the actor's {len(shards)} local "
            "parameter shards (different model or sharding than the one it was taken from)"
        )


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Σ numel × element size."""
    return sum(t.numel() * t.element_size() for t in tensors)


class ParamSwap:
    """Loads other weights into a model's local shards in place and puts the originals back.

    The originals are saved once per ``borrow`` into a reusable buffer (allocated on first use, in
    the parameters' dtype, on ``device`` or else the parameters' device); every copy is one
    ``_foreach_copy_``.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._saved: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the reusable buffer (0 before the first swap)."""
        return 0 if self._saved is None else nbytes(self._saved)

    @contextmanager
    def borrow(
        self, model: nn.Module, restore_from: list[torch.Tensor] | None = None
    ) -> Iterator[Callable[[list[torch.Tensor]], None]]:
        """Yield ``load(weights)``, which copies weights into the model's local shards in place;
        the original weights are back on exit (also on error).

        ``restore_from``: a bit-exact copy of the model's current local shards that is kept
        anyway (e.g. the snapshot of the version the model holds): the originals are restored
        from it, so no buffer is allocated or written.
        """
        shards = local_shards(model)
        layout = [(s.shape, s.dtype) for s in shards]
        if restore_from is None and (
            self._saved is None or [(s.shape, s.dtype) for s in self._saved] != layout
        ):
            self._saved = alloc_like(shards, dtype=None, device=self.device)

        def load(weights: list[torch.Tensor]) -> None:
            check_like("the weights to load", weights, shards)
            # a forward may have left unsharded copies that would shadow the write
            reshard_all(model)
            torch._foreach_copy_(shards, weights)

        with torch.no_grad():
            if restore_from is None:
                torch._foreach_copy_(self._saved, shards)
            try:
                yield load
            finally:
                load(self._saved if restore_from is None else restore_from)


class PublishedWeights:
    """A copy of the weights last published to the engines (``rollout.sync_every > 1``).

    Inside a sync cycle the trainer keeps training while the engines keep the cycle's weights;
    the anchors that mean "the policy before this update" (decoupled PPO's π_old) must then come
    from those published weights for every step of the cycle, not from weights already moved by
    its earlier steps. ``take`` copies this rank's local shards at each publish (one buffer,
    reused: the previous cycle's copy is overwritten); ``holding(actor)`` puts them into the
    actor for a no-grad pass and the actor's own weights back afterwards (a swap buffer of the
    same size). Both live on the host (pinned with CUDA) unless ``device`` says otherwise.
    Stateful: a run resumed inside a cycle anchors with the same weights.
    """

    def __init__(self, device: torch.device | str | None = "cpu"):
        self.device = None if device is None else torch.device(device)
        self.version: int | None = None
        self._copy: list[torch.Tensor] | None = None
        self._swap = ParamSwap(self.device)

    def take(self, actor: nn.Module, version: int) -> None:
        """Copy the actor's current local shards as the weights of ``version``."""
        shards = local_shards(actor)
        if self._copy is None:
            self._copy = alloc_like(shards, dtype=None, device=self.device)
        check_like("the published weights", self._copy, shards)
        with torch.no_grad():
            torch._foreach_copy_(self._copy, shards)
        self.version = int(version)

    @contextmanager
    def holding(self, actor: nn.Module) -> Iterator[None]:
        """The actor holds the published weights inside the block, its own ones afterwards."""
        if self._copy is None:
            raise RuntimeError("PublishedWeights.holding before the first take()")
        with self._swap.borrow(actor) as load:
            load(self._copy)
            yield

    def state_dict(self) -> dict:
        return {"version": self.version, "weights": self._copy}

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        weights = state["weights"]
        if weights is None:
            self._copy = None
            return
        self._copy = alloc_like(list(weights), dtype=None, device=self.device)
        with torch.no_grad():
            torch._foreach_copy_(self._copy, list(weights))
