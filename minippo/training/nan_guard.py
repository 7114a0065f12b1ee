"""Skip optimizer steps whose loss or gradient norm is not finite.

A single NaN/inf gradient applied by Adam poisons every weight it touches (and the moment
estimates, forever). The guard sits between ``backward`` + gradient clipping and
``optimizer.step()``::

    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if guard.check(loss, grad_norm, step=step):      # all ranks agree on the answer
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)           # a skipped step leaves no gradient behind

``check`` returns False for a non-finite loss or norm (the caller then skips the step: weights and
optimizer state stay untouched), counts consecutive skips and raises :class:`NonFiniteError` once
``max_consecutive`` skips in a row were seen. A finite step resets the run of skips.
:func:`clip_and_step` is that sequence for one model (the recipe calls it per optimizer step).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minippo.parallel.distributed import collective_device

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised when too many optimizer steps in a row had a non-finite loss or gradient norm."""


def all_finite(*values: torch.Tensor | float) -> bool:
    """True when every value is finite on every rank (one all-reduce when distributed).

    Each value is a scalar tensor or a float. With a process group, a value that is non-finite
    on any rank makes the answer False everywhere, so all ranks skip the same optimizer steps.
    The flags are combined on the device: one host sync per call, whatever the number of values.
    """
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    device = collective_device(default=device)
    flags = [
        torch.isfinite(torch.as_tensor(v, dtype=torch.float32)).all().to(device) for v in values
    ]
    ok = torch.stack(flags).all().to(torch.float32) if flags else torch.ones((), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() > 0.5)


class NonFiniteGuard:
    """Counts non-finite optimizer steps; see the module docstring.

    Args:
        max_consecutive: raise after this many non-finite steps in a row (>= 1).

    Attributes:
        skipped_total: optimizer steps skipped so far.
        consecutive: current run of skipped steps.
    """

    def __init__(self, max_consecutive: int = 3) -> None:
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(
                f"max_consecutive_nonfinite must be an integer >= 1, got {max_consecutive!r}; "
                "e.g. max_consecutive_nonfinite=3"
            )
        self.max_consecutive = max_consecutive
        self.skipped_total = 0
        self.consecutive = 0

    def check(
        self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float, *, step: int
    ) -> bool:
        """True: take the optimizer step. False: skip it (and zero the gradients).

        Raises NonFiniteError when this is the ``max_consecutive``-th non-finite step in a row.
        """
        if all_finite(loss, grad_norm):
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        loss_f = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        norm_f = (
            float(grad_norm.detach()) if isinstance(grad_norm, torch.Tensor) else float(grad_norm)
        )
        log.warning(
            "step %d: non-finite loss (%s) or grad norm (%s); optimizer step skipped "
            "(%d in a row, limit %d)",
            step,
            loss_f,
            norm_f,
            self.consecutive,
            self.max_consecutive,
        )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"step {step}: {self.consecutive} optimizer steps in a row had a non-finite loss "
                f"or gradient norm (last: loss={loss_f}, grad_norm={norm_f}); the run is stopped "
                "with the weights of the last finite step. Lower optimizer.lr, check the data and "
                "rewards for NaN/inf, or raise max_consecutive_nonfinite "
                f"(now {self.max_consecutive})."
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_total = int(state["skipped_total"])
        self.consecutive = int(state["consecutive"])


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    guard: NonFiniteGuard,
    loss: torch.Tensor | float,
    *,
    max_norm: float,
    step: int,
) -> tuple[torch.Tensor, bool]:
    """The sequence of the module docstring for ``model``'s gradients: clip their norm to
    ``max_norm`` (under FSDP2 the norm of the full gradient, the same on every rank), step
    ``optimizer`` unless ``guard`` finds ``loss`` or the norm non-finite, zero the gradients.

    Returns: (the norm before clipping, a scalar tensor; whether the optimizer stepped).
    Raises :class:`NonFiniteError` as :meth:`NonFiniteGuard.check` does.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    stepped = guard.check(loss, norm, step=step)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped
