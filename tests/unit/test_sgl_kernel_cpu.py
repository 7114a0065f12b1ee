"""The pure-torch ``sgl_kernel`` functions SGLang's CPU path calls (minippo.engine._sgl_kernel_cpu),
against the semantics of the Triton kernels they replace, written out as loops."""

from __future__ import annotations

import pytest
import torch

from minippo.engine import _sgl_kernel_cpu as kernels


def test_assign_req_to_token_pool_writes_each_requests_slots_into_its_row():
    req_to_token = torch.full((5, 12), -1, dtype=torch.int32)
    rows = torch.tensor([3, 0, 4])
    start, end = torch.tensor([2, 0, 5]), torch.tensor([5, 4, 5])  # the last one gets no slot
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)  # 3 + 4 + 0 slots, in order
    kernels.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out_cache_loc, 12)
    want = torch.full((5, 12), -1, dtype=torch.int32)
    offset = 0
    for row, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        for pos in range(s, e):
            want[row, pos] = 100 + offset
            offset += 1
    assert torch.equal(req_to_token, want)
    with pytest.raises(ValueError, match="pool_len"):
        kernels.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out_cache_loc, 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_copies_rows_in_every_buffer(dtype):
    """Buffers given by raw address and row stride in bytes (SGLang's data_ptrs / data_strides):
    row src[j] lands on row tgt[j] in each, every source read before any write (a chain
    2 -> 5, 5 -> 1 moves the old row 5, not the new one)."""
    buffers = [torch.randn(8, 3, 4).to(dtype) for _ in range(3)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    tgt, src = torch.tensor([5, 1, 6]), torch.tensor([2, 5, 6])
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(buffers, before):
        want = old.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            want[t] = old[s]
        assert torch.equal(b, want)
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])  # nothing to move


def test_speculative_decoding_names_refuse_to_run():
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        kernels.verify_tree_greedy_cpu()
    assert set(kernels.__all__) <= set(dir(kernels))
