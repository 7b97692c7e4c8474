"""Quantization math: scheme validation, qdq quality (SQNR), int32 packing."""

from __future__ import annotations

import pytest
import torch

from llmpress.errors import SchemeError
from llmpress.lifecycle.state import scheme_of
from llmpress.quant import (
    PRESET_SCHEMES,
    QuantizationArgs,
    dequantize,
    fake_quantize,
    pack_to_int32,
    preset_scheme,
    quantize,
    unpack_from_int32,
    weight_qparams,
)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum()))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_bits": 4, "strategy": "group", "group_size": 0}, "group_size > 0"),
        ({"num_bits": 9}, "num_bits"),
        ({"num_bits": 6, "type": "float"}, "float8"),
        ({"num_bits": 4, "type": "float"}, "NVFP4"),  # fp4 per tensor: neither NVFP4's scales nor MXFP4's
        ({"strategy": "token"}, "dynamic=True"),
        ({"strategy": "channel", "group_size": 64}, "strategy='group'"),
        ({"observer": "maxmin"}, "unknown observer"),
    ],
)
def test_bad_args_say_how_to_fix(kwargs, words):
    with pytest.raises(SchemeError) as info:
        QuantizationArgs(**kwargs)
    assert words in str(info.value)
    assert "Fix:" in str(info.value)


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(SchemeError, match="did you mean 'W4A16'"):
        preset_scheme("W4A61")


def test_group_size_alone_means_group_strategy():
    args = QuantizationArgs(num_bits=4, group_size=64)
    assert args.strategy == "group"


@pytest.mark.parametrize("preset", list(PRESET_SCHEMES))
def test_presets_read_back_from_json(preset):
    scheme = preset_scheme(preset)
    assert type(scheme).model_validate(scheme.to_json()) == scheme


@pytest.mark.parametrize(
    "args, min_db",
    [
        (QuantizationArgs(num_bits=8, strategy="channel"), 38.0),
        (QuantizationArgs(num_bits=4, strategy="group", group_size=128), 16.0),
        (QuantizationArgs(num_bits=4, strategy="group", group_size=128, symmetric=False), 17.0),
        (QuantizationArgs(num_bits=8, type="float", strategy="tensor"), 25.0),
        (QuantizationArgs(num_bits=8, type="float", strategy="channel"), 28.0),
    ],
)
def test_weight_qdq_quality(args, min_db):
    weight = torch.randn(64, 300)  # 300 columns: the last group of 128 is shorter
    scale, zero_point = weight_qparams(weight, args)
    approx = fake_quantize(weight, scale, zero_point, args)
    assert sqnr_db(weight, approx) > min_db
    if args.strategy == "group":
        assert scale.shape == (64, 3)


def test_values_on_the_grid_round_trip_exactly():
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False)
    weight = torch.randn(16, 80)
    scale, zero_point = weight_qparams(weight, args)
    q = quantize(weight, scale, zero_point, args)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    on_grid = dequantize(q, scale, zero_point, args)
    assert torch.equal(quantize(on_grid, scale, zero_point, args), q)


def _reference_qdq(x, scale, zero_point, args):
    """quantize / dequantize written with every qparam copied out to each column."""
    from llmpress.quant.qdq import expand_to_columns

    s = expand_to_columns(scale, x.shape[-1], args).float()
    z = None if zero_point is None else expand_to_columns(zero_point, x.shape[-1], args).float()
    q_min, q_max = args.q_range
    scaled = x.float() / s
    if args.is_float:
        q = scaled.clamp(q_min, q_max).to(torch.float8_e4m3fn)
        return q, (q.float() * s)
    q = torch.clamp(torch.round(scaled if z is None else scaled + z), q_min, q_max).to(torch.int8)
    return q, ((q.float() if z is None else q.float() - z) * s)


@pytest.mark.parametrize(
    "args",
    [
        QuantizationArgs(num_bits=4, strategy="group", group_size=32),
        QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
        QuantizationArgs(num_bits=8, strategy="channel"),
        QuantizationArgs(num_bits=8, type="float", strategy="tensor"),
    ],
)
@pytest.mark.parametrize("columns", [96, 80])  # whole groups, and a shorter last group
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "bfloat16"])
def test_qdq_equals_the_column_wise_formula(args, columns, layout):
    """Group qparams broadcast per group (no column-wide copy) give the same bits as the plain
    formula, whatever the input's layout and dtype, and never write into the input."""
    weight = torch.randn(columns, 24).t() if layout == "transposed" else torch.randn(24, columns)
    weight = weight.to(torch.bfloat16) if layout == "bfloat16" else weight
    scale, zero_point = weight_qparams(weight, args)
    before = weight.clone()
    q = quantize(weight, scale, zero_point, args)
    expected_q, expected_values = _reference_qdq(weight, scale, zero_point, args)
    assert torch.equal(q.float(), expected_q.float())
    assert torch.equal(dequantize(q, scale, zero_point, args), expected_values)
    q32 = q.float()  # integers held as float32: dequantize must not rescale them in place
    assert torch.equal(dequantize(q32, scale, zero_point, args), expected_values)
    assert torch.equal(q32, q.float())
    assert torch.equal(weight, before)



@pytest.mark.parametrize("spec", [{"strategy": "channel"}, {"strategy": "group", "group_size": 128},
                                  {"strategy": "group", "group_size": 32}, {"strategy": "group", "group_size": 16},
                                  {"strategy": "tensor_group", "group_size": 16, "type": "float"}])
@pytest.mark.parametrize(("rows", "columns"), [(48, 256), (40, 200), (3, 5)])  # whole groups, a shorter last one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ranges_of_a_transposed_weight_are_those_of_its_copy(spec, rows, columns, dtype):
    """GPTQ observes the transpose of its working ``[in, out]`` copy: the min and max of each
    unit, reduced across the outputs from the contiguous layout, are the contiguous copy's, in
    the same shape and dtype."""
    from llmpress.quant.qdq import reduce_min_max

    args = QuantizationArgs(num_bits=4, **spec)
    weight = torch.randn(columns, rows).to(dtype).t()
    for found, expected in zip(reduce_min_max(weight, args), reduce_min_max(weight.contiguous(), args), strict=True):
        assert found.shape == expected.shape and found.dtype == expected.dtype and found.is_contiguous()
        assert torch.equal(found, expected)

def test_mse_observer_never_worse_than_minmax():
    weight = torch.randn(32, 256)
    weight[0, 0] = 25.0  # an outlier that minmax must cover
    errors = {}
    for observer in ("minmax", "mse"):
        args = QuantizationArgs(num_bits=4, strategy="group", group_size=128, observer=observer)
        errors[observer] = float((fake_quantize(weight, *weight_qparams(weight, args), args) - weight).pow(2).sum())
    assert errors["mse"] < errors["minmax"]


def _sequential_mse_search(weight, args, grid=100.0, maxshrink=0.2, patience=5, norm=2.4):
    """llm-compressor's MSE search as it runs: one shrink factor at a time, each unit keeping a
    factor only when it lowers its error, stopping after ``patience`` factors in a row that
    improve no unit."""
    from llmpress.quant.observers import _candidate_errors
    from llmpress.quant.qdq import compute_qparams, reduce_min_max

    min_vals, max_vals = reduce_min_max(weight, args)
    best = best_scale = best_zp = None
    idle = 0
    for step in range(int(maxshrink * grid)):
        scale, zp = compute_qparams(min_vals * (1 - step / grid), max_vals * (1 - step / grid), args)
        error = _candidate_errors(weight, scale.unsqueeze(0), None if zp is None else zp.unsqueeze(0), args, norm)[0]
        error = error.reshape(scale.shape)
        improved = torch.ones_like(error, dtype=torch.bool) if best is None else error < best
        if best is None or improved.any():
            best = error if best is None else torch.where(improved, error, best)
            best_scale = scale if best_scale is None else torch.where(improved, scale, best_scale)
            if zp is not None:
                best_zp = zp if best_zp is None else torch.where(improved, zp, best_zp)
            idle = 0
        else:
            idle += 1
            if idle >= patience:
                break
    return best_scale, best_zp


def _mse_case(seed: int, strategy: str, patience: int) -> tuple[torch.Tensor, QuantizationArgs]:
    generator = torch.Generator().manual_seed(seed)
    if seed == 0:  # many units, outliers: clipping them pays off for some units, not others
        weight = torch.randn(48, 256, generator=generator) * torch.rand(48, 1, generator=generator)
        weight[::7, ::13] *= 6
    else:  # few values: an error curve with bumps, where the patience stop matters
        weight = torch.randn(2, 64, generator=generator)
    args = QuantizationArgs(num_bits=3, strategy=strategy, group_size=32 if strategy == "group" else None,
                            symmetric=strategy != "channel", observer="mse", observer_kwargs={"patience": patience})
    return weight, args


@pytest.mark.parametrize(("seed", "strategy"), [(0, "group"), (0, "channel"), (0, "tensor"), (3, "tensor"), (16, "group")])
@pytest.mark.parametrize("patience", [0, 1, 5])
@pytest.mark.parametrize("chunk_elements", [1, 1 << 19])  # one factor at a time; many at once
def test_mse_observer_searches_as_llm_compressor(seed, strategy, patience, chunk_elements, monkeypatch):
    import llmpress.quant.observers as observers

    monkeypatch.setattr(observers, "_CANDIDATE_ELEMENTS", chunk_elements)
    weight, args = _mse_case(seed, strategy, patience)
    scale, zero_point = weight_qparams(weight, args)
    expected_scale, expected_zp = _sequential_mse_search(weight, args, patience=patience)
    assert torch.equal(scale, expected_scale)
    assert (zero_point is None) == (expected_zp is None)
    if zero_point is not None:
        assert torch.equal(zero_point, expected_zp)


def test_mse_patience_can_stop_before_the_best_factor():
    weight, args = _mse_case(3, "tensor", patience=5)
    patient = args.model_copy(update={"observer_kwargs": {"patience": 1000}})
    assert not torch.equal(weight_qparams(weight, args)[0], weight_qparams(weight, patient)[0])


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(5, 37), (3, 128), (7, 1), (64, 1)])  # (64, 1): a per-channel zero point, packed along dim 0
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_matches_compressed_tensors(bits, shape, dim):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    values = torch.randint(low, high + 1, shape, dtype=torch.int8)
    packed = pack_to_int32(values, bits, dim)
    assert torch.equal(packed, helpers.pack_to_int32(values, bits, packed_dim=dim))
    assert torch.equal(unpack_from_int32(packed, bits, shape, dim), values)


def test_int4_packs_eight_values_per_word():
    values = torch.tensor([[1, -1, 2, -2, 3, -3, 7, -8]], dtype=torch.int8)
    word = int(pack_to_int32(values, 4)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [v + 8 for v in values[0].tolist()]


@pytest.mark.parametrize("preset", ["W4A16", "W8A16", "W4A16_ASYM", "FP8"])
def test_finished_layers_wait_as_integers_and_come_back_bit_for_bit(preset):
    from llmpress.lifecycle.attach import attach_scheme, freeze_weight
    from llmpress.pipelines.storage.compact import CompactWeights
    from llmpress.quant.presets import preset_scheme

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 32))
    attach_scheme(layer[0], preset_scheme(preset))
    freeze_weight(layer[0])  # on its grid; layer[1] is plain and stays as it is
    weight, plain, param = layer[0].weight.detach().clone(), layer[1].weight, layer[0].weight
    held = CompactWeights()
    freed = held.hold(layer)
    assert freed == weight.numel() * 4 and held.held_bytes < freed
    if preset == "W4A16":  # symmetric 4-bit integers wait two to a byte
        assert held.held_bytes == weight.numel() // 2
    assert layer[0].weight.is_meta and layer[1].weight is plain
    with pytest.raises(RuntimeError, match="held as integers"):
        layer(torch.randn(2, 256))  # a held layer cannot be run by mistake
    held.restore()
    assert layer[0].weight is param and torch.equal(param, weight) and held.held_bytes == 0


@pytest.mark.parametrize("shape", [(1, 8), (7, 24), (3, 64)])
def test_nibble_packing_round_trips_every_4_bit_integer(shape):
    from llmpress.pipelines.storage.compact import _packed, _unpacked

    k = torch.arange(shape[0] * shape[1], dtype=torch.int8).remainder(16).sub(8).reshape(shape)  # -8..7
    packed = _packed(k)
    assert packed.numel() * packed.element_size() == k.numel() // 2  # two to a byte
    assert torch.equal(_unpacked(packed, k.shape), k)
    wide = torch.tensor([[-9, 7] * 4], dtype=torch.int8)  # out of 4-bit range: kept as it is
    assert _packed(wide) is wide
    ragged = k.reshape(-1, 1)[:7]  # rows that do not fill whole words: kept as they are
    assert _packed(ragged) is ragged


def test_a_weight_off_its_grid_is_not_held():
    from llmpress.lifecycle.attach import attach_scheme, freeze_weight
    from llmpress.pipelines.storage.compact import CompactWeights
    from llmpress.quant.presets import preset_scheme

    linear = torch.nn.Linear(128, 16)
    attach_scheme(linear, preset_scheme("W4A16"))
    freeze_weight(linear)
    linear.weight.data.add_(1e-3)  # moved off the grid (training, say)
    assert CompactWeights().hold(linear) == 0 and not linear.weight.is_meta


def test_a_shared_weight_is_not_held():
    from llmpress.lifecycle.attach import attach_scheme, freeze_weight
    from llmpress.pipelines.storage.compact import CompactWeights
    from llmpress.quant.presets import preset_scheme

    first, second = torch.nn.Linear(128, 16), torch.nn.Linear(128, 16)
    second.weight = first.weight  # tied
    attach_scheme(first, preset_scheme("W4A16"))
    freeze_weight(first)
    model = torch.nn.Sequential(first, second)
    assert CompactWeights(model).hold(model[0]) == 0 and not first.weight.is_meta


def test_importing_the_package_is_cheap_and_names_arrive_on_use():
    import subprocess
    import sys

    probe = (
        "import sys, llmpress\n"
        "assert 'torch' not in sys.modules, 'import llmpress pulled in torch'\n"
        "from llmpress import Recipe, oneshot\n"
        "assert callable(oneshot) and Recipe.__name__ == 'Recipe'\n"
        "assert llmpress.quant.PRESET_SCHEMES and 'quant' in dir(llmpress)\n"
        "try:\n"
        "    llmpress.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=300)


@pytest.mark.parametrize("kwargs", [
    {"num_bits": 8, "strategy": "token", "dynamic": True},
    {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": False},
    {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
    {"num_bits": 8, "strategy": "channel"},
    {"num_bits": 8, "strategy": "tensor"},
])
def test_fake_quantize_is_dequantize_of_quantize_bit_for_bit(kwargs):
    """Integer grids fake-quantize in one float buffer, without the int8 copy: the same bits."""
    from llmpress.quant.qdq import activation_qparams

    args = QuantizationArgs(**kwargs)
    x = torch.randn(48, 96) * torch.linspace(0.01, 4, 96)  # small columns: values rounding to zero, of both signs
    scale, zero_point = activation_qparams(x, args)
    expected = dequantize(quantize(x, scale, zero_point, args), scale, zero_point, args)
    assert torch.equal(fake_quantize(x, scale, zero_point, args).view(torch.int32), expected.view(torch.int32))  # -0.0 too
    low = x.to(torch.bfloat16)
    expected = dequantize(quantize(low, scale, zero_point, args), scale, zero_point, args, torch.bfloat16)
    assert torch.equal(fake_quantize(low, scale, zero_point, args).view(torch.int16), expected.view(torch.int16))


def test_modules_reading_one_input_share_its_dynamic_fake_quantization(monkeypatch):
    """q/k/v read one tensor with equal dynamic args: it is fake-quantized once a forward, and
    each gets what a quantization of its own gives; a tensor written in between, or one with
    calibrated qparams, is quantized again."""
    import llmpress.lifecycle.attach as attach
    from llmpress.lifecycle.attach import attach_scheme, fake_quantize_module_input
    from llmpress.quant import preset_scheme

    computed = []
    real = attach.fake_quantize_activation
    monkeypatch.setattr(attach, "fake_quantize_activation", lambda *a, **k: computed.append(1) or real(*a, **k))
    q, k, v = (torch.nn.Linear(64, 64) for _ in range(3))
    for module in (q, k, v):
        attach_scheme(module, preset_scheme("W8A8"))
    args = scheme_of(q).input_activations
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        outs = [fake_quantize_module_input(m, x, args) for m in (q, k, v)]
    assert len(computed) == 1 and all(torch.equal(o, real(x, args)) for o in outs)
    x.mul_(2)  # written: its version moved
    with torch.no_grad():
        again = fake_quantize_module_input(k, x, args)
    assert len(computed) == 2 and torch.equal(again, real(x, args))
    del x, outs, again
    assert attach._shared_input.entry is None  # the result went with its input
    with torch.inference_mode():  # inference tensors have no version counter: each module its own
        z = torch.randn(4, 64)
        fake_quantize_module_input(q, z, args), fake_quantize_module_input(k, z, args)
    assert len(computed) == 4 and attach._shared_input.entry is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: plain code, no shared state
    y = torch.randn(4, 64)
    with torch.no_grad():
        fake_quantize_module_input(q, y, args), fake_quantize_module_input(k, y, args)
    assert len(computed) == 6 and attach._shared_input.entry is None
