"""fp4 (NVFP4, MXFP4) and FP8 block: the grids, the scales, the packed formats, against
compressed-tensors' own compressors where it is installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmpress.errors import SchemeError
from llmpress.formats import FORMATS, format_for
from llmpress.formats.fp4_packed import pack_fp4, unpack_fp4
from llmpress.lifecycle.attach import attach_scheme, freeze_weight, fused_families, share_global_scales
from llmpress.lifecycle.state import scheme_of
from llmpress.quant.presets import preset_scheme
from llmpress.quant.qdq import compute_qparams, dequantize, fake_quantize_activation, quantize, round_to_grid
from llmpress.quant.scheme import QuantizationArgs


def test_fp4_rounds_to_nearest_with_ties_to_even():
    args = preset_scheme("NVFP4A16").weights
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.1, -2.5, -6.5, 0.74, 1.24, 1.76])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -2.0, -6.0, 0.5, 1.0, 2.0])
    q = round_to_grid(x.clone(), args)
    assert torch.equal(q, expected)
    assert torch.signbit(q[10])  # a negative value rounded to zero keeps its sign (code 0x8)


def test_fp4_packing_order_and_codes():
    values = torch.tensor([[0.5, -1.5, 6.0, -0.0, 0.0, 3.0, -6.0, 2.0]])
    packed = pack_fp4(values)
    assert packed.tolist() == [[0x1 | (0xB << 4), 0x7 | (0x8 << 4), 0x0 | (0x5 << 4), 0xF | (0x4 << 4)]]
    back = unpack_fp4(packed)
    assert torch.equal(back, values) and torch.equal(torch.signbit(back), torch.signbit(values))


def test_mx_scales_are_powers_of_two_rounded_up_near_the_next():
    args = preset_scheme("MXFP4A16").weights
    absmax = torch.tensor([1.0, 1.5, 1.74, 1.75, 6.0, 7.0, 0.0])
    scale, _ = compute_qparams(-absmax, absmax, args)
    codes = (torch.log2(scale) + 127).round()
    assert codes.tolist() == [125, 125, 125, 126, 127, 128, 0]


@pytest.mark.parametrize("preset, bits", [("MXFP4A16", 4), ("MXFP8A16", 8)])
def test_mx_scales_are_compressed_tensors_codes(preset, bits):
    """The e8m0 codes compressed-tensors' observer gives (``generate_mx_scales``), fp4 and fp8
    alike, near powers of two and between them."""
    mx = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    absmax = torch.cat([torch.tensor([1.0, 1.5, 1.74, 1.75, 1.76, 6.0, 7.0, 448.0, 500.0, 2.0**-20]), torch.rand(200) * 100])
    scale, _ = compute_qparams(-absmax, absmax, preset_scheme(preset).weights)
    ours = (torch.log2(scale) + 127).round()
    assert torch.equal(ours, mx.generate_mx_scales(absmax, bits).float())
    if bits == 8:  # fp8's group maximum fits 448 (fp4's may clip at 6 by up to 1.75 / 1.5: the rounding both share)
        assert float((absmax / scale).max()) <= 448.0


def test_nvfp4_needs_its_global_scale():
    args = preset_scheme("NVFP4A16").weights
    with pytest.raises(SchemeError, match="global scale"):
        quantize(torch.randn(4, 16), torch.ones(4, 1), None, args)


@pytest.mark.parametrize("fields", [
    {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16},  # fp4 without NVFP4/MX scales
    {"num_bits": 4, "type": "int", "strategy": "tensor_group", "group_size": 16},
    {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16, "scale_dtype": "torch.uint8"},  # MX groups are 32
    {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
    {"num_bits": 8, "type": "float", "block_structure": [128, 128]},  # block without strategy
    {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16, "dynamic": "local"},
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.nosuch"},
])
def test_bad_microscaling_schemes_are_refused(fields):
    with pytest.raises(SchemeError):
        QuantizationArgs(**fields)


def _linear(rows, cols, scheme, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(cols, rows, bias=False).to(dtype)
    attach_scheme(linear, preset_scheme(scheme))
    return linear


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_BLOCK"])
def test_frozen_weight_round_trips_through_its_format(scheme):
    linear = _linear(200, 256, scheme)  # 200 rows: FP8_BLOCK's last row block is short
    freeze_weight(linear)
    state = {k: v for k, v in {**linear._parameters, **linear._buffers}.items() if v is not None}
    fmt = FORMATS.get(format_for(scheme_of(linear)))
    stored = fmt.compress(state, scheme_of(linear))
    back = fmt.decompress(stored, scheme_of(linear), torch.float32)["weight"]
    assert torch.equal(back, linear.weight.data)


def test_fused_modules_share_one_global_scale():
    parent = nn.Module()
    for name, gain in (("q_proj", 1.0), ("k_proj", 3.0), ("v_proj", 0.5), ("o_proj", 2.0)):
        linear = _linear(32, 64, "NVFP4A16")
        linear.weight.data *= gain
        setattr(parent, name, linear)
    families = fused_families(parent)
    share_global_scales([parent.q_proj, parent.o_proj], families)
    shared = parent.q_proj.weight_global_scale
    assert torch.equal(shared, parent.k_proj.weight_global_scale) and torch.equal(shared, parent.v_proj.weight_global_scale)
    largest = max(parent.q_proj.weight.abs().max(), parent.k_proj.weight.abs().max(), parent.v_proj.weight.abs().max())
    assert torch.allclose(shared, 2688.0 / largest)
    assert torch.allclose(parent.o_proj.weight_global_scale, 2688.0 / parent.o_proj.weight.abs().max())


ct_compressors = pytest.importorskip("compressed_tensors.compressors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_fp4_bytes_equal_compressed_tensors(scheme, dtype):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    linear = _linear(64, 128, scheme, dtype)
    linear.weight.data[3, :32] = 0  # an all-zero group
    weight = linear.weight.data.clone()
    theirs_scheme = preset_name_to_scheme(scheme, ["Linear"])
    args = theirs_scheme.weights
    size = args.group_size
    groups = weight.unflatten(-1, (-1, size))
    global_scale = generate_gparam(weight.amin().reshape(1), weight.amax().reshape(1)) if scheme.startswith("NV") else None
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale.to(dtype)}
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    compressor = NVFP4PackedCompressor if scheme.startswith("NV") else MXFP4PackedCompressor
    theirs = compressor.compress(state, theirs_scheme)

    freeze_weight(linear)
    ours_state = {k: v for k, v in {**linear._parameters, **linear._buffers}.items() if v is not None}
    ours = FORMATS.get(format_for(scheme_of(linear))).compress(ours_state, scheme_of(linear))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else ours[name],
                           tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor), name


def test_fp8_block_scales_cover_short_blocks():
    linear = _linear(200, 300, "FP8_BLOCK")
    freeze_weight(linear)
    assert tuple(linear.weight_scale.shape) == (2, 3)
    q = quantize(linear.weight.data, linear.weight_scale, None, scheme_of(linear).weights)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(q, linear.weight_scale, None, scheme_of(linear).weights), linear.weight.data)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_BLOCK"])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_on_microscaling_grids_beats_rtn_and_stays_on_its_grid(scheme, actorder):
    from llmpress.modifiers.gptq.algorithm import gptq_quantize
    from llmpress.quant.observers import weight_global_scale, weight_qparams
    from llmpress.quant.qdq import fake_quantize

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=generator) @ torch.randn(256, 256, generator=generator) / 16
    w = torch.randn(96, 256, generator=generator)
    args = preset_scheme(scheme).weights
    gs = weight_global_scale([w]) if args.has_global_scale else None
    result = gptq_quantize(w, 2 * x.t() @ x / len(x), args, actorder=actorder, global_scale=gs)
    rtn = fake_quantize(w, *weight_qparams(w, args, gs), args, gs)

    def error(q):
        return float(((q - w) @ x.t()).pow(2).mean())

    assert error(result.weight) < 0.8 * error(rtn)
    regrid = fake_quantize(result.weight.contiguous(), result.scale, result.zero_point, args, gs)
    torch.testing.assert_close(regrid, result.weight, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_BLOCK"])
def test_runtime_products_match_the_dequantized_weight(scheme, tmp_path):
    """Prefill (32 rows and more) multiplies exactly what the dense view does; decode runs in
    bf16, within its rounding."""
    from helpers import make_tiny_llama, token_batches

    import llmpress

    llmpress.oneshot(make_tiny_llama(intermediate=256), scheme, token_batches(), output_dir=tmp_path / "c")
    module = llmpress.load(tmp_path / "c").model.layers[0].mlp.down_proj
    assert module.kernel == "bf16"
    reference = module.dequantized_weight(torch.float64)
    inputs = scheme_of(module).input_activations  # FP8_BLOCK's: fp8 per group of 128, dynamic
    for rows, tolerance in ((64, 1e-6), (1, 1e-2)):
        x = torch.randn(rows, module.in_features)
        seen = x if inputs is None else fake_quantize_activation(x, inputs)
        expected = seen.double() @ reference.t()
        assert float((module(x).double() - expected).norm() / expected.norm()) < tolerance, rows


def test_fp8_block_round_trips_through_transformers(tmp_path):
    """An FP8_BLOCK checkpoint read by transformers + compressed-tensors gives the logits of
    llmpress's own dense view. k/v_proj have 64 rows: a short row block. (compressed-tensors'
    inputs in groups of 128 need features in 128s: intermediate 256, not 200.)"""
    transformers = pytest.importorskip("transformers")
    from helpers import make_tiny_llama, token_batches

    import llmpress

    llmpress.oneshot(make_tiny_llama(intermediate=256), "FP8_BLOCK", token_batches(), output_dir=tmp_path / "c")
    assert llmpress.load(tmp_path / "c").model.layers[0].self_attn.k_proj.weight_scale.shape[0] == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "c"), dtype=torch.float32).eval()
    ours = llmpress.load(tmp_path / "c", dequantize=True)
    ids = torch.tensor(token_batches(2, 16))
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-6


def test_half_precision_models_stay_finite(tmp_path):
    """NVFP4 products are global-scale times too large before the division: never in fp16. MX
    scales of all-zero groups (2^-127) stay float32, not 0 (0 / 0 would be NaN)."""
    from helpers import make_tiny_llama, token_batches

    import llmpress

    model = make_tiny_llama(intermediate=256)
    llmpress.oneshot(model, "NVFP4A16", output_dir=tmp_path / "c")
    ids = torch.tensor(token_batches(2, 16))
    with torch.no_grad():
        half = llmpress.load(tmp_path / "c", dtype=torch.float16)
        for tokens in (ids, ids[:1, :1]):  # prefill, decode
            assert torch.isfinite(half(input_ids=tokens).logits).all()
    linear = _linear(32, 64, "MXFP4A16", torch.float16)
    linear.weight.data[0, :32] = 0
    freeze_weight(linear)
    assert linear.weight_scale.dtype == torch.float32 and torch.isfinite(linear.weight).all()


def test_frozen_nvfp4_checkpoints_run_in_llmpress_load(tmp_path):
    """``save_compressed=False``: dense on-grid weights beside their scales and global scale."""
    from helpers import make_tiny_llama, token_batches

    import llmpress

    llmpress.oneshot(make_tiny_llama(intermediate=256), "NVFP4A16", output_dir=tmp_path / "c", save_compressed=False)
    ids = torch.tensor(token_batches(2, 16))
    with torch.no_grad():
        runtime = llmpress.load(tmp_path / "c")(input_ids=ids).logits
        dense = llmpress.load(tmp_path / "c", dequantize=True)(input_ids=ids).logits
    assert float((runtime - dense).norm() / dense.norm()) < 1e-5


def test_compressed_tensors_spellings_are_read():
    assert QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="LOCAL").dynamic == "local"
    assert QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure="128x128").block_structure == [128, 128]
    assert QuantizationArgs(num_bits=8, type="float", scale_dtype="torch.float8_e5m2").scale_dtype == "torch.float8_e5m2"
