"""FSDP2 sharding of the decoder models and gathering of full tensors.

Typical use (every rank runs the same code)::

    with torch.device("meta"):
        model = Transformer(args)
    shard_model(model, param_dtype=torch.bfloat16)
    load_full_state_dict(model, full_sd, device=info.device)   # full_sd: native names
    ...
    for bucket in full_tensor_buckets(model, bucket_bytes=1 << 28, dtype=torch.bfloat16):
        engine.publish(...)                                       # [(hf_name, full tensor), ...]
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from minippo.models.hf_checkpoint import hf_name

__all__ = [
    "assert_not_meta",
    "export_hf",
    "exported_step",
    "full_tensor_buckets",
    "gather_full_state_dict",
    "load_full_state_dict",
    "reshard_all",
    "set_replica_sync",
    "shard_model",
]


def shard_model(
    model: nn.Module,
    *,
    mesh=None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    sum_gradients: bool = False,
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every decoder block, then to the root; returns ``model``.

    Works for :class:`~minippo.models.Transformer` and :class:`~minippo.models.ValueModel` (any
    module with ``.layers``), on real or meta parameters. The root group holds the embeddings, the
    final norm and the head (tied weights stay one parameter). ``param_dtype`` is the compute
    dtype of the all-gathered parameters (None: the stored dtype); ``reduce_dtype`` the dtype of
    the gradient reduce-scatter. ``mesh`` None uses all ranks of the default process group.
    ``sum_gradients``: reduce gradients by their sum over ranks instead of FSDP's default mean
    (gradient divide factor 1), for losses that are already each rank's share of a global loss
    (the recipe's: see ``minippo.rl.aggregation``), so no loss needs a world-size multiplier.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs a process group: call minippo.parallel.init_distributed() under "
            "torchrun, or do not shard in a single process"
        )
    if not hasattr(model, "layers"):
        raise TypeError(f"shard_model expects a model with .layers, got {type(model).__name__}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root's inputs keep their dtype: FSDP2 would cast every floating tensor of the forward's
    # arguments to param_dtype, dataclasses included, and the scoring spec carries the policy
    # loss's fp32 anchors, advantages, weights and token counts (``ScoreSpec.fused``): in bf16
    # an anchor of -5.3 would reach the loss as -5.3125. The model computes in param_dtype
    # anyway (its embedding output is), and its blocks still cast what they receive.
    root_mp = replace(mp, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
    if sum_gradients:
        for m in model.modules():
            if isinstance(m, FSDPModule):  # a plain SUM (PREMUL_SUM does not exist on gloo)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return model


def set_replica_sync(model: nn.Module | None, enabled: bool) -> None:
    """HSDP: whether the next backward of ``model`` all-reduces its gradients across the replicas
    (the nodes). Gradients are reduce-scattered inside the node on every backward either way;
    with ``enabled`` False they are summed locally until a backward with it True all-reduces the
    sum, so gradient accumulation crosses the nodes once per optimizer step instead of once per
    micro-batch. No effect on FSDP over one mesh dimension, on a plain module or on None."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)


def assert_not_meta(model: nn.Module) -> None:
    """Raise if any parameter or buffer is still on the meta device."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors left on the meta device, e.g. {left[:4]}")


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    device: torch.device | str,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Materialise a (possibly meta-built, sharded) model on ``device`` and load full tensors.

    state_dict: ``{native_name: full tensor}`` (e.g. ``load_hf_state_dict(path)[1]``); the tied
    ``output.weight`` may be absent. With ``broadcast_from_rank0`` only rank 0 needs it (others pass
    None or {}) and rank 0 broadcasts. Each rank keeps only its shard. Returns ``model``.
    """
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)  # Transformer re-ties its lm_head in _apply
    sd = dict(state_dict or {})
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    if tied and "tok_embeddings.weight" in sd:
        sd.setdefault("output.weight", sd["tok_embeddings.weight"])
    if not broadcast_from_rank0 or not dist.is_initialized() or dist.get_rank() == 0:
        expected = set(model.state_dict())
        missing, unexpected = expected - set(sd), set(sd) - expected
        if missing or unexpected:
            raise ValueError(
                f"state dict does not match the model: missing {sorted(missing)[:6]}, "
                f"unexpected {sorted(unexpected)[:6]}"
            )
    set_model_state_dict(
        model,
        sd,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0),
    )
    assert_not_meta(model)
    return model


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in the sharded state (no-op for a plain model).

    After a forward without backward FSDP2 may keep parameters unsharded (always for the root):
    the registered parameters are then plain full (param_dtype) tensors that the next forward
    reuses and the next reshard discards. Reading or writing the sharded parameters (the fp32
    masters, or their local shards) is only meaningful after this.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _full(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter, cast to ``dtype`` first (so a bf16
    gather moves half the bytes of an fp32 one); a collective for DTensors."""
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_tensor_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full tensor)`` of at most ``bucket_bytes`` each (a single larger
    tensor gets a bucket of its own), in parameter order, identical on every rank.

    The tied lm_head is skipped (it is the embedding). For FSDP-sharded models every rank must
    consume the whole iterator: each tensor is all-gathered. ``dtype`` casts the gathered tensors
    (e.g. bf16 for an engine). Tensors stay on the parameters' device.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be positive")
    reshard_all(model)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in model.named_parameters():  # a tied lm_head is the same Parameter: listed once
        t = _full(p, dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name(name), t))
        size += nbytes
    if bucket:
        yield bucket


def gather_full_state_dict(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """``{native_name: full tensor}`` of a sharded (or plain) model, on ``device``.

    A collective: every rank must call it. With ``rank0_only`` the other ranks take part in the
    gathers but keep nothing and get ``{}`` (host memory for one copy, not one per rank). The tied
    ``output.weight`` is not included (pass the result to
    :func:`~minippo.models.save_pretrained_state_dict` for an HF export).
    """
    reshard_all(model)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, p in model.named_parameters():
        t = _full(p, dtype)
        if keep:
            out[name] = t.to(device)
    return out


EXPORT_INFO = "minippo_export.json"  # {"step": N}: written into the export folder last


def export_hf(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    step: int | None = None,
) -> None:
    """Write a (sharded or plain) :class:`~minippo.models.Transformer` as an HF folder: config.json
    + safetensors, the tokenizer files found in ``tokenizer_dir`` (e.g. the checkpoint the run
    started from) and, with ``step``, :data:`EXPORT_INFO` (the training steps the weights have
    had). Collective: every rank gathers, rank 0 alone holds the copy and writes.

    Atomic: everything goes into ``<path>.tmp`` (each file fsynced), which is then renamed to
    ``path``; an export already at ``path`` is renamed aside first and deleted after. A process
    killed at any point leaves either a complete folder at ``path`` or none (the old one, or the
    leftovers of a killed export, are removed by the next export): :func:`exported_step` tells.
    """
    from minippo.models import TOKENIZER_FILES, save_pretrained_state_dict

    state = gather_full_state_dict(model, rank0_only=True)  # {} off rank 0
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    for leftover in [tmp, *final.parent.glob(f"{final.name}.old-*")]:  # from a killed export
        shutil.rmtree(leftover, ignore_errors=True)
    save_pretrained_state_dict(state, model.args, tmp)
    for name in TOKENIZER_FILES:
        if tokenizer_dir and (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    if step is not None:
        (tmp / EXPORT_INFO).write_text(json.dumps({"step": int(step)}) + "\n")
    for file in tmp.iterdir():  # the data on disk before the name that says it is complete
        _fsync(file)
    _fsync(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def exported_step(path: str | Path) -> int | None:
    """The ``step`` of a complete :func:`export_hf` folder at ``path``; None when there is none
    (never written, or a kill interrupted the export) or it was written without ``step``."""
    try:
        info = json.loads((Path(path) / EXPORT_INFO).read_text(encoding="utf-8"))
        return int(info["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
