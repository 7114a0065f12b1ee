"""Simulated FP8 / int8 rollouts (minippo.engine.quantize): the rounding error of each format is
within its arithmetic bound, only the linear layers (not the output layer, embeddings or norms)
are rounded, and the activation hooks feed each linear layer rounded inputs."""

import pytest
import torch
from torch import nn

from minippo.engine.quantize import (
    check_quant_format,
    fake_quantize,
    quantize_linear_inputs,
    quantize_linear_weights_,
)
from minippo.models import Transformer, init_weights, qwen3_tiny


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * torch.logspace(-3, 2, 16)[:, None]
    x[3] = 0.0  # a row of zeros
    x[5, :8] = 1e-9  # tiny values next to large ones: subnormal territory of the row's scale
    return x


def test_fp8_error_is_the_e4m3_rounding():
    """E4M3 keeps 3 mantissa bits: a value in the normal range moves by at most half a unit in
    the last place, 2^-4 relative; below the smallest normal (2^-6 in scaled units) the step is
    the subnormal spacing 2^-9, so the absolute error is at most 2^-10 x the row's scale."""
    x = _rows()
    q = fake_quantize(x, "fp8")
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert (q - x).abs().le(bound + 1e-30).all()
    assert q[3].eq(0).all()
    # the row maximum is exactly representable (it maps to 448)
    i = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(q.gather(-1, i), x.gather(-1, i), rtol=2**-23, atol=0)
    assert (q != x).any()


def test_int4_error_is_half_a_step_of_its_group():
    """int4 shares one scale per 32 consecutive inputs: each value moves by at most half a step
    of its group's scale (absmax / 7), takes one of 15 codes, and a group's maximum is exact.
    Its error is far above int8's on the same values (the point of the format here)."""
    from minippo.engine.quantize import INT4_GROUP

    x = _rows()
    q = fake_quantize(x, "int4")
    groups = x.unflatten(-1, (-1, INT4_GROUP))
    scale = (groups.abs().amax(-1, keepdim=True) / 7.0).expand_as(groups).reshape(x.shape)
    assert (q - x).abs().le(scale / 2 * (1 + 2**-20)).all()
    assert q[3].eq(0).all()
    codes = (q.unflatten(-1, (-1, INT4_GROUP)) / scale.unflatten(-1, (-1, INT4_GROUP))).nan_to_num()
    assert codes.round().sub(codes).abs().max() < 1e-4 and codes.abs().max() <= 7 + 1e-4
    i = groups.abs().argmax(-1, keepdim=True)
    qg = q.unflatten(-1, (-1, INT4_GROUP))
    torch.testing.assert_close(qg.gather(-1, i), groups.gather(-1, i), rtol=2**-22, atol=0)
    assert (q - x).abs().mean() > 4 * (fake_quantize(x, "int8") - x).abs().mean()
    # a row that does not divide into groups shares one scale
    odd = torch.randn(3, 33)
    assert (
        (fake_quantize(odd, "int4") - odd)
        .abs()
        .le(odd.abs().amax(-1, keepdim=True) / 14 * (1 + 2**-20))
        .all()
    )


def test_int8_error_is_half_a_step():
    x = _rows()
    q = fake_quantize(x, "int8")
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    assert (q - x).abs().le(scale / 2 * (1 + 2**-20)).all()
    assert q[3].eq(0).all()
    # at most 255 distinct values per row
    assert all(torch.unique(row).numel() <= 255 for row in q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_and_shape_are_kept(dtype):
    x = _rows().to(dtype)
    for fmt in ("fp8", "int8", "int4"):
        q = fake_quantize(x, fmt)
        assert q.dtype == dtype and q.shape == x.shape


def test_only_the_linear_layers_are_rounded():
    args = qwen3_tiny()
    model = init_weights(Transformer(args), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = quantize_linear_weights_(model, "fp8")
    after = dict(model.named_parameters())
    linears = [
        m for name, m in model.named_modules() if type(m) is nn.Linear and m is not model.output
    ]
    assert n == len(linears) > 0
    for name, p in after.items():
        changed = not torch.equal(p, before[name])
        is_linear = any(p is m.weight for m in linears)
        assert changed == is_linear, name
        if is_linear:
            torch.testing.assert_close(p, fake_quantize(before[name], "fp8"), rtol=0, atol=0)
    # the output layer (tied or not) and the embedding are untouched
    out_name = "output.weight" if "output.weight" in before else "tok_embeddings.weight"  # tied
    assert torch.equal(model.output.weight, before[out_name])
    assert torch.equal(model.tok_embeddings.weight, before["tok_embeddings.weight"])


def test_fp8_activation_hooks_round_each_linear_input():
    fmt = "fp8"
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(32, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    x = torch.randn(4, 5, 32)
    handles = quantize_linear_inputs(lin, fmt)
    assert len(handles) == 2
    got = lin(x)
    want = lin[2](fake_quantize(lin[1](lin[0](fake_quantize(x, fmt))), fmt))
    for h in handles:
        h.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(lin(x), got)  # the hooks did change something, and are gone
    assert quantize_linear_inputs(lin, "int8") == []  # weight-only
    assert quantize_linear_inputs(lin, "int4") == []


def test_bad_format_names_the_key():
    assert check_quant_format(None) is None and check_quant_format("fp8") == "fp8"
    with pytest.raises(ValueError, match=r"engine\.quantize must be null or one of"):
        check_quant_format("fp4")
