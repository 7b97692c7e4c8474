"""Hugging Face fp8 checkpoints (block scales, ``weight_scale_inv``) as sources for any recipe."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import checkpoint_tensors, hf_fp8_copy, make_tiny_llama, token_batches

import llmpress
from llmpress.errors import CheckpointError
from llmpress.loading.inspect import describe_checkpoint


@pytest.fixture
def fp8_source(tmp_path):
    bf16 = tmp_path / "bf16"
    make_tiny_llama(intermediate=200).to(torch.bfloat16).save_pretrained(bf16)  # down_proj: a partial column block
    return hf_fp8_copy(bf16, tmp_path / "fp8")


def test_it_loads_dense_on_its_grid(fp8_source, tmp_path):
    stored = checkpoint_tensors(fp8_source)
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    model = llmpress.load_checkpoint(fp8_source, dtype=None)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16 and not any(n.endswith("scale_inv") for n in model.state_dict())
    scale = stored["model.layers.0.mlp.down_proj.weight_scale_inv"]
    expected = (stored["model.layers.0.mlp.down_proj.weight"].float()
                * scale.repeat_interleave(128, 0)[:128].repeat_interleave(128, 1)[:, :200]).to(torch.bfloat16)
    assert torch.equal(weight, expected)
    assert describe_checkpoint(fp8_source)["format"].startswith("Hugging Face fp8, block(128x128)")


def test_any_recipe_compresses_it_as_it_compresses_the_dense_weights(fp8_source, tmp_path):
    dense = tmp_path / "dense"
    model = llmpress.load_checkpoint(fp8_source, dtype=None)
    model.save_pretrained(dense)
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    recipe = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n"
    for source, out in ((fp8_source, tmp_path / "from-fp8"), (dense, tmp_path / "from-dense")):
        llmpress.oneshot(source, recipe, token_batches(), output_dir=out)
    assert (tmp_path / "from-fp8" / "model.safetensors").read_bytes() == (tmp_path / "from-dense" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W4A16", "NVFP4A16"])
def test_the_model_free_path_reads_it_as_the_model_class_path_does(fp8_source, tmp_path, preset):
    from llmpress.model_free import quantize_model_free

    llmpress.oneshot(fp8_source, preset, output_dir=tmp_path / "model", model_free=False)
    quantize_model_free(fp8_source, preset, tmp_path / "free")
    assert (tmp_path / "free" / "model.safetensors").read_bytes() == (tmp_path / "model" / "model.safetensors").read_bytes()
    config = json.loads((tmp_path / "free" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((tmp_path / "model" / "config.json").read_text())["quantization_config"]
    assert config["dtype"] == "bfloat16"


def test_a_weight_without_its_scale_is_named(fp8_source):
    from safetensors.torch import load_file, save_file

    weights = fp8_source / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match="lack their weight or scale"):
        llmpress.load_checkpoint(fp8_source)


def test_scales_llmpress_cannot_read_are_refused(fp8_source):
    config = json.loads((fp8_source / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (fp8_source / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="scale_fmt"):
        llmpress.load_checkpoint(fp8_source)
