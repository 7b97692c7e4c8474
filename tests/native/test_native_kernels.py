"""llmpress's own CPU operators for quantized linears (llmpress/native): the int4 integer product
and the int8 one for decode, and the dequantize-and-multiply for prefill (float32, and bf16 for int4 and int8)
against a float64 reference, the blocks64 layout's round
trips, PyTorch's kernel still serving when they are off, and torch.compile calling them."""

from __future__ import annotations

import pytest
import torch

from llmpress import native
from llmpress.quant import QuantizationArgs, QuantizationScheme
from llmpress.quant.packing import pack_to_int32
from llmpress.runtime import QuantizedLinear, kernels

pytestmark = pytest.mark.skipif(not native.available(), reason="llmpress's int4 kernels do not build on this machine")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def grid(rows, cols, group, symmetric=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (rows, cols), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, cols // group, generator=g) + 0.05
    zero_point = None if symmetric else torch.randint(-3, 4, (rows, cols // group), dtype=torch.int8, generator=g)
    dense = q.double() - (0 if zero_point is None else zero_point.double().repeat_interleave(group, 1))
    return q, scale, zero_point, dense * scale.double().repeat_interleave(group, 1)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("rows", "cols", "group"), [(96, 576, 64), (7, 256, 32), (50, 512, 256), (13, 384, 128)])
def test_int4_linear_matches_float64(rows, cols, group, symmetric):
    q, scale, zero_point, dense = grid(rows, cols, group, symmetric, seed=rows)
    packed, table = kernels.int4_pack(q, scale, zero_point)
    assert packed.dtype == torch.uint8 and table.dtype == torch.float32
    for tokens in (1, 3, 16, 17, 40):  # up to 16: the integer product; more: float32 on dequantized rows
        x = torch.randn(2, tokens, cols, generator=torch.Generator().manual_seed(tokens))
        out = kernels.int4_matmul(x, packed, group, table)
        assert out.shape == (2, tokens, rows) and out.dtype == torch.float32
        assert rel(out, x.double() @ dense.t()) < (1e-4 if tokens <= 16 else 1e-6)
    for dtype in (torch.bfloat16, torch.float16):  # bf16 runs as it is, other dtypes through float32
        x = torch.randn(1, cols).to(dtype)
        out = kernels.int4_matmul(x, packed, group, table)
        assert out.dtype == dtype and rel(out, x.double() @ dense.t()) < 1e-2


@pytest.mark.parametrize(("rows", "cols", "group"), [(96, 576, 64), (2100, 4096, 128)])  # the second: two pieces of rows
def test_bf16_prefill_is_the_dense_bf16_product(rows, cols, group):
    """More than 16 bf16 rows multiply in bf16 where the CPU does so natively: exactly what a
    dense bf16 model of the dequantized weight computes (up to oneDNN's blocking when the
    weight goes in pieces); elsewhere they run in float32."""
    q, scale, zero_point, dense = grid(rows, cols, group, symmetric=False, seed=3)
    packed, table = kernels.int4_pack(q, scale, zero_point)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = kernels.int4_matmul(x, packed, group, table)
    assert out.dtype == torch.bfloat16 and out.shape == (40, rows)
    bf16_dense = native.int4_dequantize(packed, table, group).bfloat16()
    # the operator itself, whichever the CPU: bf16 products on bf16 rows (on AMX tiles where it
    # can, 96 rows; else oneDNN's, 2100 rows), which differ from oneDNN's only in the order of
    # their float32 sums
    direct = native.int4_linear(x, packed, table, group)
    assert rel(direct, x @ bf16_dense.t()) < 2e-4
    assert rel(out, x.double() @ dense.t()) < 1e-2


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize(("rows", "cols"), [(72, 200), (64, 256)])  # 200 columns: not on AMX, a tail shorter than 16
def test_int8_prefill_in_bf16(zero, rows, cols):
    """8-bit weights in prefill: ``q * scale - correction`` rounded to bf16 per row, one bf16
    product; the decode kernel (PyTorch's) agrees to bf16's rounding."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    scale = (torch.rand(rows, generator=g) * 0.01 + 1e-3).bfloat16()
    correction = (torch.rand(rows, generator=g) * 0.01).bfloat16() if zero else None
    w = q.float() * scale.float()[:, None] - (0 if correction is None else correction.float()[:, None])
    x = torch.randn(3, 20, cols, generator=g).bfloat16()
    out = native.int8_linear_bf16(x, q, scale, correction)
    assert out.shape == (3, 20, rows) and rel(out, x @ w.bfloat16().t()) < 2e-4
    if kernels.int8_supported(cols):  # PyTorch's decode kernel: 16-column blocks only
        decode = kernels.int8_matmul(x[:, :2], q, scale, correction)
        assert rel(decode, out[:, :2]) < 1e-2
    assert rel(kernels.int8_matmul(x.float(), q, scale, correction), x.double() @ w.double().t()) < 1e-2
    with pytest.raises(RuntimeError, match="int8"):
        native.int8_linear_bf16(x.float(), q, scale, correction)


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize(("rows", "cols"), [(100, 96), (64, 160), (1536, 576), (576, 1536)])  # x in groups of 32, 32, 64, 128
def test_int8_decode_is_an_integer_product_near_float64(zero, rows, cols):
    """8-bit weights in decode: x quantized to int16 per group, the weight's integers widened and
    summed in int32, float32 scales: 1e-4 from the float64 product (PyTorch's kernel, in bf16:
    about 3e-3); bf16 inputs give bf16 outputs; more than 16 rows are refused."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, generator=g) * 0.01 + 1e-3
    correction = torch.rand(rows, generator=g) * 0.01 if zero else None
    w = q.double() * scale.double()[:, None] - (0 if correction is None else correction.double()[:, None])
    x = torch.randn(2, 3, cols, generator=g)
    assert rel(native.int8_linear(x, q, scale, correction), x.double() @ w.t()) < 1e-4
    assert rel(kernels.int8_matmul(x, q, scale, correction), x.double() @ w.t()) < 1e-4  # the runtime takes it
    out = native.int8_linear(x.bfloat16(), q, scale, correction)
    assert out.dtype == torch.bfloat16 and rel(out, x.bfloat16().double() @ w.t()) < 5e-3
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        native.int8_linear(torch.randn(17, cols), q, scale, correction)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.int8_linear(torch.randn(1, 48), q[:, :48].contiguous(), scale, correction)


def test_activation_outliers_keep_their_precision():
    """Each weight group of x is quantized to int16 on its own largest value: with one huge
    channel the product stays more precise than bf16 activations (PyTorch's kernel), and the
    groups without the outlier keep their full precision."""
    q, scale, _, dense = grid(64, 512, 128)
    packed, table = kernels.int4_pack(q, scale, None)
    x = torch.randn(1, 512)
    x[0, 7] = 1e4
    reference = x.double() @ dense.t()
    assert rel(kernels.int4_matmul(x, packed, 128, table), reference) < rel(x.bfloat16().double() @ dense.t(), reference) / 10
    tail = x[:, 128:]  # the other groups alone
    tail_dense = dense[:, 128:]
    q_tail, scale_tail = q[:, 128:].contiguous(), scale[:, 1:].contiguous()
    packed_tail, table_tail = kernels.int4_pack(q_tail, scale_tail, None)
    assert rel(kernels.int4_matmul(tail, packed_tail, 128, table_tail), tail.double() @ tail_dense.t()) < 1e-4


@pytest.mark.parametrize("symmetric", [True, False])
def test_blocks64_layout_round_trips(symmetric):
    q, scale, zero_point, dense = grid(40, 320, 32, symmetric)
    packed, table = kernels.int4_pack(q, scale, zero_point)
    assert kernels.int4_layout() == "blocks64" and packed.shape == (40, 160)
    assert torch.equal(kernels.int4_unpack(packed, 32, table, 320), q)
    assert torch.equal(kernels.int4_pack_words(pack_to_int32(q, 4), scale, zero_point)[0], packed)
    weight = native.int4_dequantize(packed, table, 32)
    assert torch.allclose(weight.double(), dense, rtol=0, atol=1e-6)
    if symmetric:  # (u - 8) * s by one fused multiply-add: exactly q * s
        assert torch.equal(weight, q.float() * scale.repeat_interleave(32, 1))


def test_bad_operands_are_refused_by_the_operator():
    q, scale, _, _ = grid(16, 256, 64)
    packed, table = kernels.int4_pack(q, scale, None)
    with pytest.raises(RuntimeError, match="group"):
        native.int4_linear(torch.randn(1, 256), packed, table, 48)
    with pytest.raises(RuntimeError, match="weight must be"):
        native.int4_linear(torch.randn(1, 128), packed, table, 64)


def test_pytorchs_kernel_serves_where_llmpress_kernels_are_off(monkeypatch):
    monkeypatch.setattr(kernels, "int4_layout", lambda: "aten")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, group_size=64))
    q, scale, _, dense = grid(96, 576, 64)
    module = QuantizedLinear(576, 96, scheme)
    module.load_quantized(q, scale)
    assert module.kernel == "int4" and module.int4_table.dtype == torch.bfloat16  # PyTorch's layout
    x = torch.randn(3, 576)
    assert rel(module(x), x.double() @ dense.t()) < 1e-2


def test_compiled_graph_calls_the_operator():
    q, scale, _, dense = grid(64, 256, 64)
    packed, table = kernels.int4_pack(q, scale, None)

    def step(x):
        return torch.nn.functional.silu(kernels.int4_matmul(x, packed, 64, table)) * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = torch.randn(1, 256)
    assert torch.allclose(compiled(x), step(x), rtol=1e-5, atol=1e-5)


def test_a_dtype_cast_of_the_model_keeps_the_kernels_tables():
    """model.to(torch.bfloat16) casts floating buffers: the int4 table keeps its float32 (its
    dtype also says which layout the weight is in), the stored scales theirs (a later save
    writes the same numbers), and the module computes as before."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, group_size=64))
    q, scale, _, dense = grid(64, 256, 64)
    module = QuantizedLinear(256, 64, scheme)
    module.load_quantized(q, scale)
    x = torch.randn(2, 256)
    before = module(x)
    module.to(torch.bfloat16)
    assert module.int4_table.dtype == torch.float32 and module.int4_weight.dtype == torch.uint8
    assert rel(module(x.bfloat16()), before) < 1e-2 and torch.equal(module.dequantized_weight(torch.float32), q.float() * scale.repeat_interleave(64, 1))
