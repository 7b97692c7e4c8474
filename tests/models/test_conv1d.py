"""GPT-2's ``Conv1D``: a linear layer stored input-major ``[in, out]``, quantized as the linear it
is, in the layout compressed-tensors reads (qparams along the output features of each input
feature). The architecture matrix covers the command line end to end (gpt2, openai-gpt)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from helpers import correlated_problem, output_error, train_steps

import llmpress
from llmpress.lifecycle.attach import attach_scheme
from llmpress.lifecycle.qat import enable_qat
from llmpress.lifecycle.state import scheme_of
from llmpress.models.linear import Conv1D, linear_weight
from llmpress.modifiers import GPTQModifier, MagnitudePruningModifier, QuantizationModifier
from llmpress.modifiers.gptq.algorithm import gptq_quantize
from llmpress.quant import QuantizationArgs, fake_quantize, weight_qparams
from llmpress.runtime import QuantizedLinear

ARGS = [
    QuantizationArgs(num_bits=4, group_size=128),
    QuantizationArgs(num_bits=3, group_size=64, symmetric=False),
    QuantizationArgs(num_bits=4, group_size=100),  # the last group of each column shorter
    QuantizationArgs(num_bits=8, strategy="channel"),
    QuantizationArgs(num_bits=8, type="float", strategy="tensor"),
]


def tiny_gpt2(seed: int = 0, vocab: int = 512):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=4, n_positions=64)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("args", ARGS)
@pytest.mark.parametrize("actorder", [False, True])
def test_input_major_gptq_lowers_output_error_and_stays_on_its_grid(args, actorder):
    w, x, hessian = correlated_problem(rows=256, cols=192)  # stored as Conv1D: [192 in, 256 out]
    stored = w.t().contiguous()
    result = gptq_quantize(stored, hessian, args, actorder=actorder, input_major=True)
    assert result.weight.shape == stored.shape
    rtn = fake_quantize(stored, *weight_qparams(stored, args), args)  # the same layout, rounded to nearest
    assert output_error(w, result.weight.t(), x) < 0.75 * output_error(w, rtn.t(), x)
    # every stored row (one input feature) lies on the grid of its own scales, as compressed-tensors reads them
    expected_scale = {"group": (192, -(-256 // (args.group_size or 1))), "channel": (192, 1), "tensor": (1,)}[args.strategy]
    assert tuple(result.scale.shape) == expected_scale
    regrid = fake_quantize(result.weight, result.scale, result.zero_point, args)
    torch.testing.assert_close(regrid, result.weight, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args", ARGS[:4])
def test_input_major_gptq_with_uncorrelated_inputs_is_round_to_nearest(args):
    """A diagonal Hessian spreads no error: each column keeps its own rounding, on the grid its
    own values give (minmax)."""
    stored = torch.randn(160, 256, generator=torch.Generator().manual_seed(1))
    hessian = torch.diag(torch.rand(160, generator=torch.Generator().manual_seed(2)) + 0.5)
    result = gptq_quantize(stored, hessian, args, input_major=True)
    scale, zero_point = weight_qparams(stored, args)
    torch.testing.assert_close(result.scale, scale)
    torch.testing.assert_close(result.weight, fake_quantize(stored, scale, zero_point, args))


def test_input_major_tensor_scale_is_the_linear_solve_transposed():
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    w, _, hessian = correlated_problem(rows=64, cols=96)
    linear = gptq_quantize(w, hessian, args)
    stored = gptq_quantize(w.t().contiguous(), hessian, args, input_major=True)
    torch.testing.assert_close(stored.weight, linear.weight.t())
    torch.testing.assert_close(stored.scale, linear.scale)


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
@pytest.mark.parametrize("modifier", [QuantizationModifier, GPTQModifier])
def test_linear_targets_quantize_conv1d_and_the_checkpoint_names_it(modifier, scheme, tmp_path):
    model = tiny_gpt2()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    llmpress.oneshot(model, modifier(scheme=scheme, targets=["Linear"], ignore=["lm_head"]),
                     dataset=[ids[0].tolist(), ids[1].tolist()], output_dir=tmp_path)
    block = model.transformer.h[0]
    assert isinstance(block.attn.c_attn, Conv1D) and block.attn.c_attn.weight.shape == (128, 384)
    assert block.attn.c_attn.weight_scale.shape == (128, 3)  # per input feature, groups of 128 outputs
    group = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["targets"] == ["Linear", "Conv1D"]  # compressed-tensors' "Linear" is nn.Linear only

    loaded = llmpress.load(tmp_path)
    runtime = loaded.transformer.h[0].attn.c_attn
    assert isinstance(runtime, QuantizedLinear) and runtime.input_major
    exact = llmpress.load(tmp_path, dequantize=True)
    assert isinstance(exact.transformer.h[0].attn.c_attn, Conv1D)
    with torch.no_grad():
        reference = model(ids).logits
        torch.testing.assert_close(exact(ids).logits, reference, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loaded(ids).logits.float(), reference, atol=5e-2, rtol=5e-2)


def test_a_config_that_targets_linear_leaves_conv1d_dense_as_compressed_tensors_does(tmp_path):
    """A GPT-2 checkpoint whose config says ``Linear`` (llm-compressor's recipe on GPT-2) holds
    its Conv1D weights dense: llmpress reads them as transformers does."""
    model = tiny_gpt2()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}},
        "ignore": ["lm_head"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = llmpress.load(tmp_path)
    assert isinstance(loaded.transformer.h[0].mlp.c_fc, Conv1D)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_qat_on_conv1d_computes_the_linear_on_its_grid():
    conv = Conv1D(96, 64)
    attach_scheme(conv, llmpress.quant.preset_scheme("W4A16"))
    x = torch.randn(3, 64)
    args = scheme_of(conv).weights
    on_grid = fake_quantize(conv.weight.detach(), *weight_qparams(conv.weight.detach(), args), args)
    enable_qat(conv)
    torch.testing.assert_close(conv(x), x @ on_grid + conv.bias, atol=1e-5, rtol=1e-5)
    assert type(conv).__name__ == "QATConv1D"
    twin = pickle.loads(pickle.dumps(conv))  # the QAT class is found by its name, made on first use
    assert type(twin) is type(conv)
    torch.testing.assert_close(twin(x), conv(x))


def test_two_of_four_pruning_runs_along_conv1d_inputs(tmp_path):
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = llmpress.Session(MagnitudePruningModifier(final_sparsity=0.5, end=1, mask_structure="2:4", targets=["Linear"]))
    session.initialize(model=model, optimizer=optimizer, steps_per_epoch=1)
    train_steps(session, model, optimizer, 1)
    session.finalize()
    conv = model.transformer.h[0].mlp.c_fc
    kept = (linear_weight(conv.weight, conv) != 0).reshape(-1, 4).sum(dim=1)  # blocks of 4 inputs per output
    assert int(kept.max()) <= 2 and float((conv.weight == 0).float().mean()) == pytest.approx(0.5)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["llmpress_sparsity"]
    assert record["sparsity_structure"] == "2:4"


def test_quantize_on_load_takes_conv1d_in_its_layout(tmp_path):
    from llmpress.loading import LlmpressConfig

    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "dense")
    loaded = llmpress.load(tmp_path / "dense", quantization_config=LlmpressConfig(bits=4, group_size=64), dtype=torch.float32)
    runtime = loaded.transformer.h[1].mlp.c_proj
    assert isinstance(runtime, QuantizedLinear) and runtime.input_major
    stored = model.transformer.h[1].mlp.c_proj.weight.detach()
    args = scheme_of(runtime).weights
    torch.testing.assert_close(runtime.dequantized_weight(torch.float32), fake_quantize(stored, *weight_qparams(stored, args), args))
    loaded.save_pretrained(tmp_path / "saved")
    again = llmpress.load(tmp_path / "saved", dequantize=True)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, loaded(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_conv1d_target_wins_over_the_linear_alias_whatever_the_order():
    from llmpress.targets import assign_by_targets

    model = tiny_gpt2()
    for entries in ([(["Linear"], "alias"), (["Conv1D"], "own")], [(["Conv1D"], "own"), (["Linear"], "alias")]):
        chosen = assign_by_targets(model, entries, ["lm_head"], linear_alias=True)
        assert chosen["transformer.h.0.attn.c_attn"][1] == "own"
