"""The device mesh the models are sharded over: FSDP across every rank, or HSDP across nodes.

``parallel.sharding`` (docs/multinode.md):

* ``fsdp``: one mesh dimension over all ``W`` ranks; every parameter is split ``W`` ways, so every
  forward and backward all-gathers over all ranks, across nodes when there are several.
* ``hsdp``: a 2-D mesh ``(replicate = nnodes, shard = nproc_per_node)``; a parameter is split
  over the ranks of one node and replicated across nodes. All-gathers and gradient
  reduce-scatters stay inside a node; only the gradient all-reduce of each rank's shard over
  the replicate dimension crosses nodes. On one node it is FSDP with a ``(1, W)`` mesh.

Global rank ``r`` sits at mesh coordinate ``(r // nproc_per_node, r % nproc_per_node)``: torchrun
numbers the ranks of a node consecutively, so the shard dimension is one node.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["SHARDINGS", "build_mesh", "replicas", "shard_ranks", "sharding_of"]

SHARDINGS = ("fsdp", "hsdp")
MESH_DIMS = ("replicate", "shard")


def sharding_of(cfg: Any) -> str:
    """``parallel.sharding`` of a run config (``fsdp`` when the section or key is absent)."""
    from minippo.training.preflight import setting  # the schema states the default

    sharding = setting(cfg, "parallel.sharding")
    if sharding not in SHARDINGS:
        raise ValueError(f"parallel.sharding={sharding!r} must be one of {', '.join(SHARDINGS)}")
    return sharding


def _local_world_size(world_size: int, local_world_size: int | None) -> int:
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"parallel.sharding=hsdp needs the same number of ranks on every node: "
            f"{world_size} ranks are not a multiple of {local_world_size} per node; give every "
            "node the same --nproc-per-node"
        )
    return local_world_size


def shard_ranks(sharding: str, world_size: int, local_world_size: int | None = None) -> int:
    """How many ranks one parameter is split over: ``world_size`` under ``fsdp``, the ranks of a
    node (``local_world_size``; None: ``$LOCAL_WORLD_SIZE``) under ``hsdp``. A rank's local
    shards (and so the per-rank state a checkpoint keeps) depend on this number alone."""
    if sharding not in SHARDINGS:
        raise ValueError(f"parallel.sharding={sharding!r} must be one of {', '.join(SHARDINGS)}")
    if sharding == "fsdp":
        return world_size
    return _local_world_size(world_size, local_world_size)


def build_mesh(
    sharding: str,
    world_size: int | None = None,
    local_world_size: int | None = None,
    *,
    device_type: str | None = None,
) -> DeviceMesh:
    """The mesh for ``shard_model(model, mesh=...)``; collective (call it on every rank, after
    the default process group exists).

    ``fsdp``: a 1-D mesh ``("shard",)`` over all ranks (what ``fully_shard`` builds when given no
    mesh). ``hsdp``: ``(world_size // local_world_size, local_world_size)`` named
    ``("replicate", "shard")``. ``world_size`` None: the process group's; ``local_world_size``
    None: ``$LOCAL_WORLD_SIZE`` (torchrun's ranks on this node); ``device_type`` None: ``cuda``
    when CUDA is available, else ``cpu``. The default process group stays the world's: collectives
    without a group (metrics, loss counts, the corrections' all-reduces) still span every rank.
    """
    import torch.distributed as dist

    if sharding not in SHARDINGS:
        raise ValueError(f"parallel.sharding={sharding!r} must be one of {', '.join(SHARDINGS)}")
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs a process group: call init_distributed() first")
    world_size = dist.get_world_size() if world_size is None else world_size
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if sharding == "fsdp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    per_node = _local_world_size(world_size, local_world_size)
    return init_device_mesh(
        device_type, (world_size // per_node, per_node), mesh_dim_names=MESH_DIMS
    )


def replicas(t: Any) -> int:
    """How many ranks hold the same data as this rank's part of ``t``: the size of the mesh
    dimensions a DTensor is replicated on (HSDP: nnodes), 1 for an FSDP shard or a plain tensor.
    A sum over all ranks of something computed on local shards counts every part once when each
    rank divides its term by this (the world group spans the replicas too)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return 1
    mesh = t.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())
