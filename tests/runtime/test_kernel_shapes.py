"""Real models' shapes on the int4 CPU kernel: grids the kernel does not take as they are (groups
of 128 over 576 columns, per-channel 4-bit scales) run in smaller kernel groups where that is
exact, and quantize-on-load picks a group that divides the columns."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import token_batches
from torch.nn import functional as F

import llmpress
from llmpress.formats import FORMATS
from llmpress.lifecycle.state import scheme_of
from llmpress.loading.dense import dequantize_model
from llmpress.quant import QuantizationArgs, QuantizationScheme, weight_qparams
from llmpress.runtime import QuantizedLinear, kernels


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(
    ("weights", "columns", "kernel_group"),
    [
        (dict(num_bits=4, group_size=128), 576, 64),  # SmolLM2's hidden: 4 groups of 128 and one of 64
        (dict(num_bits=4, group_size=128, symmetric=False), 960, 64),
        (dict(num_bits=4, group_size=256), 384, 128),
        (dict(num_bits=4, strategy="channel"), 576, 64),
        (dict(num_bits=4, strategy="tensor"), 512, 256),
        (dict(num_bits=4, strategy="channel", symmetric=False), 576, 64),  # zero points packed
        (dict(num_bits=4, strategy="tensor", symmetric=False), 512, 256),  # a per-tensor zero point is stored unpacked
        (dict(num_bits=4, group_size=512), 768, 256),
        (dict(num_bits=4, group_size=128), 512, 128),  # fits as it is
    ],
)
def test_a_grid_the_kernel_does_not_take_runs_on_it_in_smaller_groups_exactly(weights, columns, kernel_group):
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    weight = torch.randn(96, columns, generator=torch.Generator().manual_seed(columns))
    scale, zero_point = weight_qparams(weight, scheme.weights)
    dense = {"weight": weight, "weight_scale": scale}
    if zero_point is not None:
        dense["weight_zero_point"] = zero_point
    stored = FORMATS.get("pack-quantized").compress(dense, scheme)
    module = QuantizedLinear(columns, 96, scheme)
    module.load_compressed(stored)
    assert (module.kernel, module.int4_group) == ("int4", kernel_group)
    exact = FORMATS.get("pack-quantized").decompress(stored, scheme, torch.float32)["weight"]
    assert torch.equal(module.dequantized_weight(torch.float32), exact)  # the same grid, not an approximation
    for tokens in (1, 5, 40):  # decode (native: integer product) and prefill (native: float32 product)
        x = torch.randn(tokens, columns)
        assert rel(module(x), F.linear(x, exact)) < 1e-2  # bf16 compute where PyTorch's kernel runs
    again = module.compressed_state()  # saved as it was stored
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)


def test_quantize_on_load_picks_a_group_that_divides_the_columns(tmp_path, caplog):
    """A Llama with SmolLM2-135M's widths (hidden 576, MLP 1536, 9 heads / 3 KV heads): every
    linear runs on the int4 kernel, the modules whose 576 columns group 128 does not divide in
    groups of 64, said so, and saved as whole groups."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "fp32")
    with caplog.at_level("WARNING"):
        model = llmpress.load(tmp_path / "fp32", quantization_config=llmpress.LlmpressConfig(bits=4))
    assert "groups of 64" in caplog.text
    runtime = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {m.kernel for m in runtime.values()} == {"int4"}
    assert scheme_of(runtime["model.layers.0.mlp.down_proj"]).weights.group_size == 128  # 1536 columns
    assert scheme_of(runtime["model.layers.0.self_attn.q_proj"]).weights.group_size == 64
    ids = torch.tensor(token_batches(2, 16))
    dense = dequantize_model(copy.deepcopy(model)).float()  # the same grid, dense, in float32
    with torch.no_grad():
        for tokens in (1, 16):  # decode and prefill products
            assert rel(model(ids[:, :tokens]).logits, dense(ids[:, :tokens]).logits) < 2e-2
    model.save_pretrained(tmp_path / "q")
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted(g["weights"]["group_size"] for g in groups.values()) == [64, 128]
    reloaded = llmpress.load(tmp_path / "q")
    assert {m.kernel for m in reloaded.modules() if isinstance(m, QuantizedLinear)} == {"int4"}
    with torch.no_grad():
        assert rel(reloaded(ids).logits, model(ids).logits) < 1e-6


def test_kernel_group_choice():
    assert kernels.int4_group(96, 576, "group", 128) == 64
    assert kernels.int4_group(96, 576, "group", 32) == 32
    assert kernels.int4_group(96, 600, "group", 128) is None  # 600 columns: no kernel group divides them
    # PyTorch's kernel needs rows in 16s; llmpress's own takes any
    assert kernels.int4_group(90, 512, "group", 128) == (128 if kernels.int4_layout() == "blocks64" else None)
    assert kernels.int4_group(96, 1024, "channel", None) == 256


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_on_load_can_take_the_output_projection(tmp_path, tied):
    """``lm_head=True``: the output projection on the int4 kernel too; tied to the embedding it
    becomes a quantized copy (the embedding stays for the lookup), saved and loaded back as two
    tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "fp32")
    model = llmpress.load(tmp_path / "fp32", quantization_config=llmpress.LlmpressConfig(bits=4, lm_head=True))
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.kernel == "int4"
    assert not model.config.tie_word_embeddings
    if tied:  # the 4-bit grid of the embedding itself
        assert rel(model.lm_head.dequantized_weight(torch.float32), model.model.embed_tokens.weight.detach()) < 0.15
    ids = torch.tensor(token_batches(2, 16)) % 512
    dense = dequantize_model(copy.deepcopy(model)).float()
    with torch.no_grad():
        assert rel(model(ids).logits, dense(ids).logits) < 2e-2
    model.save_pretrained(tmp_path / "q")
    reloaded = llmpress.load(tmp_path / "q")
    assert isinstance(reloaded.lm_head, QuantizedLinear)
    with torch.no_grad():
        assert rel(reloaded(ids).logits, model(ids).logits) < 1e-5
