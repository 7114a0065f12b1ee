"""A pure-torch stand-in for SGLang's ``sgl_kernel`` package, for the real engine on a CPU.

SGLang 0.5.23's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports a module named ``sgl_kernel`` at
module level, for two functions it calls on every CPU run, and a few speculative-decoding names.
The ``sglang-kernel`` wheel on PyPI is a CUDA build (it fails to import without ``libcuda.so.1``),
so ``scripts/sglang_cpu_env.sh`` installs a package ``sgl_kernel`` whose ``__init__`` re-exports
this module. It registers no ``torch.ops.sgl_kernel`` operators, so SGLang's Intel-AMX check is
false and it takes its plain-torch kernels (the same path as on an AMD CPU without AMX).

What SGLang calls (semantics read from the call sites and the Triton kernels they replace,
``sglang/srt/mem_cache/allocation.py`` and ``sglang/kernels/ops/kvcache/cache_move.py``):

* :func:`assign_req_to_token_pool_cpu`: request ``i`` gets KV slots ``out_cache_loc[o_i : o_i +
  (end_i - start_i)]`` (``o_i`` = the slots of the requests before it) written into positions
  ``start_i .. end_i`` of its row ``req_pool_indices[i]`` of ``req_to_token``.
* :func:`copy_all_layer_kv_cache_cpu`: for every KV buffer (one per layer and K/V), given as a
  raw data pointer and its row stride in bytes, row ``src_loc[j]`` is copied onto row
  ``tgt_loc[j]`` (all reads before any write).

Speculative decoding is not supported here: its names exist (SGLang imports them at module level)
and raise ``NotImplementedError`` when called.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table, in place.

    Shapes: ``req_pool_indices``, ``start_offset``, ``end_offset`` ``[B]`` (int); ``req_to_token``
    ``[rows, pool_len]``; ``out_cache_loc`` ``[sum(end - start)]``, the new slots of request 0,
    then request 1, ...
    """
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token's row length {req_to_token.shape}")
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n]
        offset += max(n, 0)


def _rows_at(pointer: int, row_bytes: int, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``row_bytes`` bytes at address ``pointer``, as a uint8 view
    ``[rows, row_bytes]`` of that memory (no copy)."""
    raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(pointer)
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc[j] -> tgt_loc[j]`` in every buffer, in place.

    Shapes: ``data_ptrs``, ``strides`` ``[buffers]`` (uint64 address of each buffer's first row,
    its row stride in bytes); ``tgt_loc``, ``src_loc`` ``[n]`` (row indices).
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc ({tgt_loc.numel()}) and src_loc ({src_loc.numel()}) differ")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for pointer, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = _rows_at(int(pointer), int(row_bytes), rows)
        buffer[tgt] = buffer[src]  # advanced indexing reads every source row first


def _unsupported(name: str):
    def unsupported(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not supported by minippo's pure-torch "
            "CPU module (minippo.engine._sgl_kernel_cpu)"
        )

    unsupported.__name__ = unsupported.__qualname__ = name
    return unsupported


build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
