"""Bytes one training step sends across nodes, FSDP over every rank against HSDP.

The recipe's collectives per training step, per model (``minippo plan nnodes=N``; docs/multinode.md):

    training forward     all-gather of the parameters (compute dtype c), once per micro-batch
    training backward    all-gather of the decoder blocks again (``reshard_after_forward``; FSDP2
                         keeps the root group, embeddings and head, unsharded until backward ends)
    gradients            FSDP: reduce-scatter (reduce dtype, fp32) once per micro-batch;
                         HSDP: reduce-scatter inside the node once per micro-batch, all-reduce of
                         the shard across the nodes once per optimizer step (the recipe defers it
                         to the last micro-batch of each minibatch: ``set_replica_sync``)
    no-grad passes       all-gather per forward: reference logprobs, critic values, the
                         correction's scoring passes, ceil(rows per rank / score rows) each
    publish              all-gather of the actor in the engine's dtype, every ``sync_every`` steps

Bytes across nodes, n nodes of g ranks (W = n·g), S the full size of what one collective moves,
NCCL's ring with the ranks of a node consecutive (one ring edge leaves each node; several
channels split S between their rings without changing the sum):

    all-gather / reduce-scatter over all W ranks      (W − 1)/W · S out of each node
    all-reduce of a 1/g shard over the n nodes         2(n − 1)/n · S/g per rank, · g per node
    collectives inside one node (HSDP's shard group)   nothing

Small all-reduces (metrics, token counts, norms, the corrections' flags) are not counted. Tree
or hierarchical algorithms, in-network reduction (SHARP) and compression change these figures;
they were not measured (this machine has no network between nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["StepShape", "Traffic", "cross_node_traffic"]

REDUCE_BYTES = 4  # the recipe's gradient reduce dtype: fp32 (shard_model's reduce_dtype)


@dataclass(frozen=True)
class StepShape:
    """What one training step runs on each rank, for counting its collectives.

    Fields:
        rows_per_rank:  sequences per rank per step (groups_per_batch · samples / ranks)
        micro_batch:    rows per training forward (ppo.micro_batch_size)
        minibatches, epochs: optimizer steps per training step = epochs · minibatches
        score_rows:     rows per no-grad forward (ppo.score_micro_batch_size; the whole batch)
        sync_every:     a publish every this many steps (rollout.sync_every)
        engine_bytes:   bytes per element of the published weights (engine.dtype)
    """

    rows_per_rank: int
    micro_batch: int
    minibatches: int
    epochs: int
    score_rows: int
    sync_every: int
    engine_bytes: int

    @property
    def micro_batches(self) -> int:
        """Training forward + backward passes per model per step."""
        rows = max(1, self.rows_per_rank // max(1, self.minibatches))  # rows per minibatch
        return self.optimizer_steps * math.ceil(rows / self.micro_batch)

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * self.minibatches

    @property
    def score_forwards(self) -> int:
        """Forwards of one no-grad pass over the rank's batch."""
        return math.ceil(self.rows_per_rank / max(1, self.score_rows))


@dataclass(frozen=True)
class Traffic:
    """Bytes out of each node per training step, by collective, under ``sharding``."""

    sharding: str
    nnodes: int
    ranks_per_node: int
    items: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)


def _model_sizes(args: Any, *, value_head: bool) -> tuple[int, int]:
    """(all parameter elements, elements of the decoder blocks) of one model."""
    from minippo.plan.formula import _block_shapes, _numel, model_param_shapes

    total = _numel(model_param_shapes(args, value_head=value_head))
    return total, args.n_layers * _numel(_block_shapes(args))


def cross_node_traffic(
    x: Any, step: StepShape, sharding: str, *, scoring_models: list[tuple[str, Any, bool]]
) -> Traffic:
    """Bytes each node sends to the others in one training step (see the module docstring).

    ``x``: the :class:`~minippo.plan.PlanInputs` (``actor``, ``critic``, ``compute_bytes``,
    ``nnodes``, ``ranks_per_node``); ``scoring_models``: the no-grad passes of step 2 as
    ``(name, ModelArgs, value_head)``, one entry per pass."""
    n, g = x.nnodes, x.ranks_per_node
    world = n * g
    c = x.compute_bytes
    trained = [("actor", x.actor, False)] + ([("critic", x.critic, True)] if x.critic else [])
    if n < 2:
        return Traffic(sharding, n, g, ())
    ring = (world - 1) / world  # all-gather / reduce-scatter over all ranks, per node
    items: list[tuple[str, int]] = []
    gather = grads = 0.0
    for _, args, head in trained:
        full, blocks = _model_sizes(args, value_head=head)
        gather += step.micro_batches * (full + blocks) * c
        if sharding == "fsdp":
            grads += ring * step.micro_batches * full * REDUCE_BYTES
        else:  # the shard of each rank all-reduced over the n nodes, g ranks per node
            grads += 2 * (n - 1) / n * step.optimizer_steps * full * REDUCE_BYTES
    scoring = 0.0
    for _, args, head in scoring_models:
        scoring += step.score_forwards * _model_sizes(args, value_head=head)[0] * c
    publish = _model_sizes(x.actor, value_head=False)[0] * step.engine_bytes / step.sync_every
    across = sharding == "fsdp"  # HSDP gathers inside the node
    items.append(("parameter all-gathers, training", int(ring * gather) if across else 0))
    items.append(("parameter all-gathers, no-grad passes", int(ring * scoring) if across else 0))
    items.append(("gradients: fsdp reduce-scatter, hsdp all-reduce", int(grads)))
    items.append(("weight publish (all-gather)", int(ring * publish) if across else 0))
    return Traffic(sharding, n, g, tuple(items))
