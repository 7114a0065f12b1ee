"""Process groups, FSDP2 sharding, and gathering full tensors (for engines and HF export).

Public names:
    init_distributed(backend=None) -> DistInfo(rank, world_size, local_rank, device, distributed)
    destroy_distributed()
    shard_model(model, *, mesh=None, param_dtype=None, reduce_dtype=torch.float32,
                reshard_after_forward=True) -> model
    load_full_state_dict(model, state_dict, *, device, broadcast_from_rank0=False) -> model
    assert_not_meta(model)
    reshard_all(model)   (every FSDP2 module back to sharded, e.g. after a no-grad forward)
    full_tensor_buckets(model, *, bucket_bytes, dtype=None) -> Iterator[list[(hf_name, Tensor)]]
    gather_full_state_dict(model, *, dtype=None, device="cpu", rank0_only=False)
        -> {native_name: Tensor}
    export_hf(model, path, *, tokenizer_dir=None, step=None)   (atomic HF folder, rank 0 writes)
    exported_step(path) -> the step of a complete export at path, or None
    apply_activation_checkpointing(model) -> model   (per decoder block; before shard_model)
    compile_blocks(model) -> model   (torch.compile per decoder block; before shard_model)
    compilation_count() -> {"graphs", "frames", "eager_frames"}   (torch.compile so far, process)
    union_over_ranks(values, device) -> sorted list   (every rank's ints, e.g. weight versions)
    max_over_ranks(values, device) -> list            (element-wise max of every rank's ints)
    build_mesh(sharding, world_size=None, local_world_size=None) -> DeviceMesh   (parallel.sharding:
        "fsdp" 1-D over all ranks, "hsdp" (replicate = nnodes, shard = nproc_per_node))
    shard_ranks(sharding, world_size, local_world_size=None) -> ranks one parameter is split over
    sharding_of(cfg) -> "fsdp" | "hsdp"
    replicas(param) -> ranks holding the same part of it (HSDP: nnodes; else 1)
    set_replica_sync(model, enabled)   (HSDP: all-reduce across nodes in the next backward or not)
    PublishedWeights()   (the weights last published, for the anchors inside a sync cycle)
    TrainerOffload([(model, optimizer | None), ...]): offload() / reload() -> seconds, moving
        parameters, gradients and optimizer states to host memory and back
"""

from minippo.parallel.activation_checkpointing import apply_activation_checkpointing
from minippo.parallel.compile import compilation_count, compile_blocks
from minippo.parallel.distributed import (
    DistInfo,
    destroy_distributed,
    init_distributed,
    max_over_ranks,
    union_over_ranks,
)
from minippo.parallel.fsdp import (
    assert_not_meta,
    export_hf,
    exported_step,
    full_tensor_buckets,
    gather_full_state_dict,
    load_full_state_dict,
    reshard_all,
    set_replica_sync,
    shard_model,
)
from minippo.parallel.mesh import SHARDINGS, build_mesh, replicas, shard_ranks, sharding_of
from minippo.parallel.offload import TrainerOffload
from minippo.parallel.weight_swap import PublishedWeights

__all__ = [
    "SHARDINGS",
    "DistInfo",
    "PublishedWeights",
    "TrainerOffload",
    "apply_activation_checkpointing",
    "assert_not_meta",
    "build_mesh",
    "compilation_count",
    "compile_blocks",
    "destroy_distributed",
    "export_hf",
    "exported_step",
    "full_tensor_buckets",
    "gather_full_state_dict",
    "init_distributed",
    "load_full_state_dict",
    "max_over_ranks",
    "replicas",
    "reshard_all",
    "set_replica_sync",
    "shard_model",
    "shard_ranks",
    "sharding_of",
    "union_over_ranks",
]
