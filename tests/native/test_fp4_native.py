"""NVFP4 / MXFP4 rounding and packing in one pass (native/fp4.cpp): PyTorch's bytes (quantize,
then pack_fp4) for every grid value, tie and edge, and NaN refused as pack_fp4 refuses it."""

from __future__ import annotations

import pytest
import torch

from llmpress import native
from llmpress.errors import CheckpointError
from llmpress.formats.fp4_packed import pack_fp4, quantize_and_pack
from llmpress.quant.presets import preset_scheme
from llmpress.quant.qdq import effective_scale, global_scale_of, quantize

pytestmark = pytest.mark.skipif(
    not (native.available() and {"avx512f", "avx512bw", "avx512dq"} <= native.cpu_flags()), reason="needs AVX-512 and llmpress's CPU operators"
)

#: grid values, ties between them (each way of rounding half to even), beyond the clamp, signed zeros
EDGES = [0.0, -0.0, 1e-9, -1e-9, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -2.5, 6.0, -6.0, 7.0, 100.0, -100.0, 0.2, 0.3,
         2.0, 4.0, 3.0, 1.5, -0.25, -0.75, 5.5, 4.5, 0.5, -1.0, 2.9999, 3.0001]


def _case(name: str, dtype: torch.dtype, rows: int = 70, cols: int = 256):
    args = preset_scheme(name).weights
    torch.manual_seed(0)
    weight = torch.randn(rows, cols) * 0.05
    weight[0, : len(EDGES)] = torch.tensor(EDGES)
    groups = -(-cols // args.group_size)
    scale = torch.rand(rows, groups) * 0.02 + 0.001
    scale[0, : len(EDGES) // args.group_size + 1] = 1.0  # the edge values land on the grid as written
    if args.has_global_scale:
        global_scale = global_scale_of(weight.abs().amax())
        scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    else:
        global_scale = None
        scale = torch.exp2(torch.round(torch.log2(scale)))
    return weight.to(dtype), scale, args, global_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_bytes_are_pytorchs(name, dtype):
    weight, scale, args, global_scale = _case(name, dtype)
    expected = pack_fp4(quantize(weight, scale, None, args, global_scale))
    packed, nans = native.fp4_quantize_pack(weight, effective_scale(scale, args, global_scale), args.group_size)
    assert nans == 0
    assert torch.equal(packed, expected)
    assert torch.equal(quantize_and_pack(weight, scale, args, global_scale), expected)


def test_nan_is_refused_like_pack_fp4():
    weight, scale, args, global_scale = _case("NVFP4A16", torch.float32)
    weight[5, 17] = float("nan")
    weight[9, 3] = float("nan")
    assert native.fp4_quantize_pack(weight, effective_scale(scale, args, global_scale), args.group_size)[1] == 2
    with pytest.raises(CheckpointError, match="NaN or inf"):
        quantize_and_pack(weight, scale, args, global_scale)


def test_declines_what_it_does_not_take():
    """Columns not a multiple of 16, or another dtype: None, and the caller takes PyTorch's route."""
    assert native.fp4_quantize_pack(torch.randn(4, 40), torch.ones(4, 3), 16) is None
    assert native.fp4_quantize_pack(torch.randn(4, 32, dtype=torch.float16), torch.ones(4, 2), 16) is None
    weight, scale, args, global_scale = _case("NVFP4A16", torch.float32, cols=40)
    assert torch.equal(quantize_and_pack(weight, scale, args, global_scale), pack_fp4(quantize(weight, scale, None, args, global_scale)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [16, 32])
def test_group_ranges_are_amin_amax(dtype, group):
    """Exact, in the weight's dtype, NaN and infinities as amin / amax give them."""
    torch.manual_seed(3)
    x = torch.randn(40, 128).to(dtype)
    x[3, 40], x[7, 0], x[8, 5], x[9, 127] = float("nan"), float("inf"), -float("inf"), -0.0
    low, high = native.group_min_max(x, group)
    grouped = x.reshape(40, -1, group)
    assert low.dtype == high.dtype == dtype
    torch.testing.assert_close(low, grouped.amin(-1), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(high, grouped.amax(-1), rtol=0, atol=0, equal_nan=True)
    assert native.group_min_max(x[:, :120], group) is None  # a shorter last group: PyTorch's route
