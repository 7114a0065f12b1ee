"""Packed passes on a CUDA GPU (marker ``gpu``): torch's varlen flash kernel, which the CPU tests
replace by a stand-in (tests/unit/test_packing.py), against the bucketed path on the same GPU, and
the packed bf16 model against the padded one.

Tolerances as in tests/unit/test_packing.py: in bfloat16 every op rounds its output to 8 bits
(u = 2⁻⁸), whatever kernel sums it; an attention output (one rounding of a softmax-weighted sum
of values in fp32 inside the kernel) differs between two kernels by at most 2u·max|v| plus the
fp32 sums; a model output by at most 2·(16·L + 3)·u·scale (16 roundings per block)."""

from __future__ import annotations

import pytest
import torch

from minippo.models import Transformer, init_weights, pack, qwen3_tiny, token_logprobs
from minippo.models.packing import bucketed_attention, uses_varlen_kernel, varlen_attention
from tests.unit.test_packing import BF16_ROUNDINGS_PER_BLOCK, U16, P, rollout_like

pytestmark = pytest.mark.gpu


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def test_varlen_kernel_equals_the_bucketed_path():
    dev = _cuda()
    _, mask, _ = rollout_like(64)
    lay = pack(mask, start=P).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    N, H, Hkv, hd = lay.num_tokens, 4, 2, 64
    q = torch.randn(N, H, hd, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(N, Hkv, hd, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(N, Hkv, hd, device=dev, generator=g, dtype=torch.bfloat16)
    assert uses_varlen_kernel(q)
    grads = {}
    for name, fn in (("varlen", varlen_attention), ("bucketed", bucketed_attention)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*x, lay)
        out.float().pow(2).sum().backward()
        grads[name] = (out.detach(), [t.grad for t in x])
    (got, g_got), (want, g_want) = grads["varlen"], grads["bucketed"]
    tol = 4 * U16 * float(v.abs().max())
    assert float((got.float() - want.float()).abs().max()) <= tol
    # backward: the same products and sums in another order, each output rounded once more
    for a, b in zip(g_got, g_want):
        assert float((a.float() - b.float()).abs().max()) <= 8 * U16 * float(b.abs().max())


def test_packed_bf16_model_equals_padded_on_cuda():
    dev = _cuda()
    tokens, mask, pos = (t.to(dev) for t in rollout_like(64))
    model = init_weights(Transformer(qwen3_tiny()), seed=3, std=0.2).to(dev, torch.bfloat16)
    with torch.no_grad():
        padded = token_logprobs(model, tokens, attention_mask=mask, position_ids=pos, start=P)
        lay = pack(mask.cpu(), start=P).to(dev)
        packed = token_logprobs(model, tokens, position_ids=pos, start=P, packed=lay)
    resp = mask[:, P:]
    scale = float(padded[resp].abs().max())
    tol = 2 * (BF16_ROUNDINGS_PER_BLOCK * model.args.n_layers + 3) * U16 * scale
    assert float((packed - padded)[resp].abs().max()) <= tol
