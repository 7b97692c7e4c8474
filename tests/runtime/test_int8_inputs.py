"""W8A8 in ``llmpress.load``: the int8 × int8 product (oneDNN) against integer arithmetic and the
fake-quantized reference, for every input-activation scheme compressed-tensors has for int8."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama, token_batches

import llmpress
from llmpress.quant import QuantizationScheme
from llmpress.quant.qdq import dequantize, fake_quantize_activation
from llmpress.runtime import QuantizedLinear, int8_inputs

pytestmark = pytest.mark.skipif(not int8_inputs._available(), reason="no oneDNN quantized linear in this torch build")


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("limit", [64, 127, -128])
def test_integer_product_is_exact(limit):
    """Whatever the CPU, the product is the exact integer one: without VNNI, weights beyond ±64
    are split into halves (one pass would saturate in int16, a relative error near 1e-2)."""
    g = torch.Generator().manual_seed(limit)
    span = min(abs(limit), 64) if limit < 0 else limit  # -128: values within ±64 but for some -128s
    weight = torch.randint(-span, span + 1, (96, 256), dtype=torch.int8, generator=g)
    weight[0, :] = limit  # the largest pair sums (int8 -128 has no positive abs())
    args = QuantizationScheme.model_validate(
        {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
         "input_activations": {"num_bits": 8, "strategy": "tensor", "dynamic": False}}).input_activations
    product = int8_inputs.Int8Inputs(weight, torch.ones(96), args)
    assert product.split == (abs(limit) > 64 and not int8_inputs._one_pass_exact())
    x = torch.randint(-128, 128, (40, 256), generator=g).float()
    x[:, 0], x[:, 1] = 127.0, -128.0  # the extremes
    out = product.matmul(x, torch.tensor([1.0]), None)  # a static scale of 1: the integers themselves
    expected = x.double() @ weight.double().t()
    assert rel(out.double(), expected) < 1e-6


SCHEMES = {
    "token-sym-dynamic": {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True},
    "token-asym-dynamic": {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": False},
    "tensor-sym-static": {"num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True},
    "tensor-asym-static": {"num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": False},
    "tensor-sym-dynamic": {"num_bits": 8, "strategy": "tensor", "dynamic": True, "symmetric": True},
    "tensor-sym-static-zero-point": {"num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True},
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_module_matches_fake_quantized_reference(name):
    scheme = QuantizationScheme.model_validate(
        {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel", "symmetric": True},
         "input_activations": SCHEMES[name]})
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (64, 128), dtype=torch.int8, generator=g)
    scale = torch.rand(64, 1, generator=g) * 1e-2 + 1e-3
    module = QuantizedLinear(128, 64, scheme, bias=True)
    module.bias = torch.nn.Parameter(torch.randn(64, generator=g), requires_grad=False)
    module.load_quantized(q, scale)
    args = scheme.input_activations
    x = torch.randn(3, 40, 128, generator=g) + 0.5
    input_scale = input_zero_point = None
    if not args.dynamic:
        input_scale = torch.tensor([x.abs().max() / 100])
        module.register_buffer("input_scale", input_scale)
        if name.endswith("zero-point"):  # a stored zero zero-point (older writers store one even when symmetric)
            input_zero_point = torch.zeros(1, dtype=torch.int8)
            module.register_buffer("input_zero_point", input_zero_point)
        if not args.symmetric:
            input_zero_point = torch.tensor([-7], dtype=torch.int8)
            module.register_buffer("input_zero_point", input_zero_point)
    assert module.kernel == "int8x8"
    weight = dequantize(q, scale, None, scheme.weights)

    def expected(inputs):
        return fake_quantize_activation(inputs, args, input_scale, input_zero_point) @ weight.t() + module.bias

    with torch.no_grad():
        assert rel(module(x), expected(x)) < 1e-5  # the long input: integers on oneDNN
        short = x[:, :2]  # decode: the bf16 int8-weight kernel
        assert rel(module(short), expected(short)) < 1e-2
    assert module._int8_inputs is not None and module.runtime_bytes() > q.numel()


def test_w8a8_checkpoint_prefill_runs_on_int8_product(tmp_path):
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "W8A8", token_batches(), output_dir=tmp_path / "c")
    runtime = llmpress.load(tmp_path / "c", dtype=torch.float32)
    dense = llmpress.load(tmp_path / "c", dequantize=True)
    layers = [m for m in runtime.modules() if isinstance(m, QuantizedLinear)]
    assert {m.kernel for m in layers} == {"int8x8"}
    ids = torch.tensor(token_batches(2, 64))
    with torch.no_grad():
        ours, theirs = runtime(input_ids=ids).logits, dense(input_ids=ids).logits
    assert all(m._int8_inputs is not None for m in layers)
    # integer sums are exact; fp32 sums in another order flip a few roundings of later inputs
    assert rel(ours, theirs) < 1e-2


def test_int8_weights_read_from_a_file_are_aligned_for_the_kernel(tmp_path):
    """A safetensors tensor starts wherever the file puts it; PyTorch's int8-weight kernel
    crashed (SIGSEGV, AVX-512) on a weight 8 bytes off a 64-byte boundary."""
    from llmpress.runtime import kernels

    unaligned = torch.randint(-127, 128, (64 * 64 + 8,), dtype=torch.int8)[8:].view(64, 64)
    assert unaligned.data_ptr() % 64 != 0 and kernels.aligned(unaligned).data_ptr() % 64 == 0
    assert torch.equal(kernels.aligned(unaligned), unaligned)
    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "W8A8", token_batches(), output_dir=tmp_path / "c")
    runtime = llmpress.load(tmp_path / "c", dtype=torch.float32)
    layers = [m for m in runtime.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.int8_weight.data_ptr() % 64 == 0 for m in layers)
    with torch.no_grad():  # a short input: the int8-weight kernel
        assert torch.isfinite(runtime(input_ids=torch.tensor(token_batches(1, 3))).logits).all()


@pytest.mark.parametrize(("in_features", "kernel"), [(200, "bf16"), (208, "int8")])
def test_int8_weights_off_16_column_blocks_do_not_reach_pytorchs_kernel(in_features, kernel):
    """PyTorch's int8-weight kernel died (SIGSEGV, AVX-512) on 200 columns: widths off its
    16-column blocks run on a bf16 copy of the weight instead, and both match the dense product."""
    scheme = QuantizationScheme.model_validate({"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}})
    module = QuantizedLinear(in_features, 48, scheme)
    q = torch.randint(-127, 128, (48, in_features), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    module.load_quantized(q, torch.full((48, 1), 1e-2))
    assert module.kernel == kernel
    x = torch.randn(3, in_features)
    assert rel(module(x), x @ (q.float() * 1e-2).t()) < 1e-2


def test_packed_weight_is_rebuilt_not_copied():
    """oneDNN's packed weight has no storage: copies and dtype moves drop it, and it is packed
    again from the int8 buffers on the next long input."""
    import copy

    scheme = QuantizationScheme.model_validate(
        {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
         "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}})
    module = QuantizedLinear(64, 32, scheme)
    module.load_quantized(torch.randint(-128, 128, (32, 64), dtype=torch.int8), torch.full((32, 1), 1e-2))
    x = torch.randn(40, 64)
    with torch.no_grad():
        expected = module(x)
        twin = copy.deepcopy(module)
        assert twin._int8_inputs is None and module._int8_inputs is not None
        assert torch.equal(twin(x), expected)
        module.to(torch.float32)
        assert module._int8_inputs is None
        assert torch.equal(module(x), expected)
