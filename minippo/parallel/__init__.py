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
    apply_activation_checkpointing(model) -> model   (per decoder block; before shard_model)
    union_over_ranks(values, device) -> sorted list   (every rank's ints, e.g. weight versions)
    PublishedWeights()   (the weights last published, for the anchors inside a sync cycle)
    TrainerOffload([(model, optimizer | None), ...]): offload() / reload() -> seconds, moving
        parameters, gradients and optimizer states to host memory and back
"""

from minippo.parallel.activation_checkpointing import apply_activation_checkpointing
from minippo.parallel.distributed import (
    DistInfo,
    destroy_distributed,
    init_distributed,
    union_over_ranks,
)
from minippo.parallel.fsdp import (
    assert_not_meta,
    export_hf,
    full_tensor_buckets,
    gather_full_state_dict,
    load_full_state_dict,
    reshard_all,
    shard_model,
)
from minippo.parallel.offload import TrainerOffload
from minippo.parallel.weight_swap import PublishedWeights

__all__ = [
    "DistInfo",
    "PublishedWeights",
    "TrainerOffload",
    "apply_activation_checkpointing",
    "assert_not_meta",
    "destroy_distributed",
    "export_hf",
    "full_tensor_buckets",
    "gather_full_state_dict",
    "init_distributed",
    "load_full_state_dict",
    "reshard_all",
    "shard_model",
    "union_over_ranks",
]
