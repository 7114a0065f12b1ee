"""Bound how far one actor update moves the tokens it was computed from (``ppo.max_update_kl``).

PPO's clip bounds how hard a token's loss still pushes; it does not bound how far one optimizer
step moves the policy. After a converged run's quiet updates, one step can move a hundred tokens
of its own minibatch from probability ~1 to ~0 (docs/learning.md, "The late collapse"), and the
run needs steps to learn them back. :class:`UpdateBound` measures each actor step on its own
tokens and shortens it when it went too far, a backtracking line search on the step::

    bound = UpdateBound(max_kl)
    bound.snapshot(actor, optimizer)                  # before optimizer.step()
    ... optimizer.step() ...
    kl = bound.settle(measure, actor, optimizer, step)

``measure()`` returns this rank's share of the token mean of k3 KL(π_before ‖ π_now) over the
step's response tokens (:meth:`UpdateBound.kl` of the logprobs the fused loss computed for the step
and of one no-grad forward with the current weights); ``settle`` sums it over the ranks. Over the
bound, the weights go to θ_before + α·(θ_stepped − θ_before) for α = 1/2, 1/4, ... (``halvings``
tries, one forward each) and the first α within the bound is kept, with the optimizer state of the
full step (its moments took the gradient; only the move is shorter). When no α is within the
bound, the step is undone: the weights and every optimizer state (moments, step counters) as
before it, bit for bit. All ranks take the same decisions (the KL is all-reduced). The learning
rate schedule advances either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from minippo.parallel.offload import copy_tensor
from minippo.rl.kl import kl_estimate

log = logging.getLogger(__name__)

HALVINGS = 5  # α down to 1/32: a KL about 1000 times smaller when it grows as α²


class UpdateBound:
    """Snapshot before an actor step; shorten or undo it when its KL exceeds ``max_kl``.

    Args:
        max_kl: the bound on the token mean of k3 KL(π_before ‖ π_after) over the step's response
            tokens (> 0).
        halvings: how many times the step may be halved before it is undone (>= 0).

    Attributes:
        shortened, undone: steps shortened / undone since the last :meth:`take_counts`.
    """

    def __init__(self, max_kl: float, halvings: int = HALVINGS) -> None:
        if not max_kl > 0:
            raise ValueError(f"ppo.max_update_kl must be > 0 or null, got {max_kl!r}")
        self.max_kl = float(max_kl)
        self.halvings = halvings
        self.shortened = self.undone = 0
        self._params: list[torch.Tensor] = []
        self._state: list[tuple[dict, dict]] = []

    def snapshot(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Copy the parameters and the optimizer state: tensors (torchao's low-bit states too)
        into new storage on their device, other values as they are."""
        with torch.no_grad():
            self._params = [p.detach().clone() for p in model.parameters()]
            self._state = [
                (st, {k: _copied(v) for k, v in st.items()}) for st in optimizer.state.values()
            ]

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the snapshot back: into the parameters in place (FSDP2 and the optimizer hold
        them), the optimizer state's entries replaced by their copies (the snapshot is dropped
        afterwards)."""
        with torch.no_grad():
            for p, saved in zip(model.parameters(), self._params, strict=True):
                p.copy_(saved)
            for st, saved in self._state:
                st.clear()
                st.update(saved)

    @staticmethod
    def kl(
        before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the token-mean k3 KL(π_before ‖ π_after): the sum over its
        masked tokens divided by the global token count ``tokens``. Add the shares of a rank's
        micro-batches; :meth:`settle` sums the ranks'."""
        k3 = kl_estimate(before, after, "k3")  # exp(after − before) − 1 − (after − before)
        return (k3 * (mask > 0)).sum() / tokens.clamp(min=1)

    def settle(
        self,
        measure: Callable[[], torch.Tensor],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
    ) -> tuple[bool, float]:
        """Keep, shorten or undo the step just taken (module docstring); drops the snapshot.
        Returns (False when it was undone, its KL before any shortening). One host sync per
        measurement."""
        first = kl = self._all_ranks(measure())
        kept = True
        if not kl <= self.max_kl:  # a NaN KL counts as too far
            with torch.no_grad():
                stepped = [p.detach().clone() for p in model.parameters()]
                alpha = 1.0
                for _ in range(self.halvings):
                    alpha /= 2
                    for p, a, b in zip(model.parameters(), self._params, stepped, strict=True):
                        p.copy_(a.lerp(b, alpha))  # θ_before + α·(θ_stepped − θ_before)
                    kl = self._all_ranks(measure())
                    if kl <= self.max_kl:
                        break
            kept = kl <= self.max_kl
            if kept:
                self.shortened += 1
                what = f"shortened to {alpha:g} of its length (KL {kl:.3g})"
            else:
                self.restore(model, optimizer)
                self.undone += 1
                what = "undone"
            log.info(
                "step %d: an actor update moved its minibatch's tokens by KL %.3g > "
                "ppo.max_update_kl=%g; %s", step, first, self.max_kl, what,
            )  # fmt: skip
        self._params, self._state = [], []
        return kept, first

    @staticmethod
    def _all_ranks(kl: torch.Tensor) -> float:
        kl = kl.detach().float().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(kl, op=dist.ReduceOp.SUM)
        return float(kl.item())

    def take_counts(self) -> tuple[int, int]:
        """(steps shortened, steps undone) since the last call; both reset to 0."""
        counts = (self.shortened, self.undone)
        self.shortened = self.undone = 0
        return counts


def _copied(value: object) -> object:
    return copy_tensor(value.detach(), value.device) if torch.is_tensor(value) else value
