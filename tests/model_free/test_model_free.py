"""Data-free recipes straight from the shards: the same checkpoint as the model-class path,
for every scheme and architecture it takes, refused where the names cannot say."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from architectures import ARCHITECTURES, RECIPE, save_tiny
from helpers import checkpoint_tensors, make_tiny_llama

import llmpress
from llmpress.errors import RecipeError
from llmpress.model_free import ModelFreeRefused, quantize_model_free
from llmpress.model_free import run as model_free_run

DATA_FREE = ["FP8_DYNAMIC", "W4A16", "W8A16", "W8A8", "FP8_BLOCK", "NVFP4A16", "MXFP4A16"]


def bf16_llama(folder, tie=False):
    model = make_tiny_llama(intermediate=256, tie=tie).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def as_bytes(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def quantization_config(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("preset", DATA_FREE)
def test_the_same_file_as_the_model_class_path(preset, tmp_path, monkeypatch):
    monkeypatch.setattr(model_free_run, "ROWS_BYTES", 2048)  # weights quantized in bands of 128 rows, joined
    source = bf16_llama(tmp_path / "source")
    llmpress.oneshot(source, preset, output_dir=tmp_path / "model", model_free=False)
    # the model-class path as the command line runs it: blocks compressed and held one by one
    llmpress.oneshot(source, preset, output_dir=tmp_path / "held", model_free=False, return_model=False)
    quantize_model_free(source, preset, tmp_path / "free")
    assert (tmp_path / "free" / "model.safetensors").read_bytes() == (tmp_path / "model" / "model.safetensors").read_bytes()
    assert (tmp_path / "held" / "model.safetensors").read_bytes() == (tmp_path / "model" / "model.safetensors").read_bytes()
    assert quantization_config(tmp_path / "free") == quantization_config(tmp_path / "model")
    assert (tmp_path / "free" / "recipe.yaml").read_text() == (tmp_path / "model" / "recipe.yaml").read_text()
    tensors = checkpoint_tensors(tmp_path / "free")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # the model's own dtype, not float32


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_each_architecture_the_same_tensors_or_a_reason(model_type, tmp_path):
    source = save_tiny(model_type, tmp_path / "source")
    recipe = RECIPE.format(modifier="QuantizationModifier")
    try:
        quantize_model_free(source, recipe, tmp_path / "free")
    except ModelFreeRefused as exc:
        assert model_type in ("gpt2", "openai-gpt", "gpt_oss", "granitemoe", "gpt_neox", "phimoe", "llava", "qwen2_vl"), f"{model_type} refused: {exc}"
        return
    llmpress.oneshot(source, recipe, output_dir=tmp_path / "model", model_free=False)
    ours, theirs = checkpoint_tensors(tmp_path / "free"), checkpoint_tensors(tmp_path / "model")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[n].dtype == theirs[n].dtype and torch.equal(as_bytes(ours[n]), as_bytes(theirs[n])) for n in ours)
    free, model = quantization_config(tmp_path / "free"), quantization_config(tmp_path / "model")
    assert sorted(free.pop("ignore")) == sorted(model.pop("ignore"))
    assert free == model


def test_without_data_the_model_class_path_holds_each_block_once_compressed(tmp_path, monkeypatch):
    from llmpress.pipelines.storage.compact import CompactWeights

    source = bf16_llama(tmp_path / "source")
    held = []
    hold = CompactWeights.hold
    monkeypatch.setattr(CompactWeights, "hold", lambda self, layer: held.append(layer) or hold(self, layer))
    llmpress.oneshot(source, "W4A16", output_dir=tmp_path / "out", model_free=False, return_model=False)
    assert len(held) == 2  # both blocks, each held as soon as it was compressed
    assert all(m.weight.is_meta for m in held[0].modules() if isinstance(m, torch.nn.Linear))


def test_shards_and_dtype(tmp_path):
    source = bf16_llama(tmp_path / "source")
    quantize_model_free(source, "W4A16", tmp_path / "one")
    quantize_model_free(source, "W4A16", tmp_path / "many", max_shard_size=200_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not list((tmp_path / "many").glob(".part*"))
    one, many = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "many")
    assert sorted(one) == sorted(many) == sorted(index["weight_map"]) and all(torch.equal(one[n], many[n]) for n in one)
    quantize_model_free(source, "W4A16", tmp_path / "fp32", dtype=torch.float32)
    wide = checkpoint_tensors(tmp_path / "fp32")
    assert wide["model.norm.weight"].dtype == wide["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    reloaded = llmpress.load(tmp_path / "many", dequantize=True)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_oneshot_takes_it_by_itself_only_when_no_model_is_asked_back(tmp_path, caplog):
    source = bf16_llama(tmp_path / "source")
    with caplog.at_level(logging.INFO, logger="llmpress"):
        assert llmpress.oneshot(source, "FP8_DYNAMIC", output_dir=tmp_path / "a", return_model=False) is None
    assert "without building the model" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmpress"):
        model = llmpress.oneshot(source, "FP8_DYNAMIC", output_dir=tmp_path / "b")
    assert model is not None and "without building the model" not in caplog.text
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_refused_with_the_reason_where_the_names_cannot_say(tmp_path):
    source = bf16_llama(tmp_path / "source", tie=True)
    gptq = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16, ignore: [lm_head]}\n"
    with pytest.raises(ModelFreeRefused, match="one QuantizationModifier"):
        llmpress.oneshot(source, gptq, output_dir=tmp_path / "a", model_free=True)
    classes = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W4A16, targets: [LlamaMLP]}\n"
    with pytest.raises(ModelFreeRefused, match="module class"):
        quantize_model_free(source, classes, tmp_path / "b")
    head = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W4A16, targets: [Linear]}\n"
    with pytest.raises(ModelFreeRefused, match="tied"):
        quantize_model_free(source, head, tmp_path / "c")
    with pytest.raises(RecipeError, match="checkpoint folder"):
        llmpress.oneshot(make_tiny_llama(), "W4A16", output_dir=tmp_path / "d", model_free=True)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    # a tied head the recipe leaves alone is listed as the model-class path lists it
    quantize_model_free(source, "W4A16", tmp_path / "e")
    llmpress.oneshot(source, "W4A16", output_dir=tmp_path / "f", model_free=False)
    assert quantization_config(tmp_path / "e") == quantization_config(tmp_path / "f")


def test_builder_writes_what_save_file_writes(tmp_path):
    from safetensors.torch import save_file

    from llmpress.tensorfiles.write import TensorFileBuilder

    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7).to(torch.float8_e4m3fn),
               "c": torch.randint(0, 9, (4,)), "e": torch.randn(2, 2), "d": torch.empty(0),
               "f": torch.zeros(3, dtype=torch.uint8), "g": torch.ones(2, dtype=torch.int32), "h": torch.ones(2, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    for hold in (0, 24, 1 << 20):  # every tensor spilled to the scratch file, some, none
        builder = TensorFileBuilder(tmp_path / "scratch", hold=hold)
        for name, tensor in tensors.items():
            builder.add(name, tensor)
        builder.write(tmp_path / "out.safetensors", {"format": "pt"})
        assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        assert not (tmp_path / "scratch").exists()


def test_a_model_free_run_never_imports_transformers(tmp_path):
    """The command's data-free path reads and writes safetensors only: no model class, so no
    transformers (a second of its start-up), and no DTensor module (torch.distributed.tensor)."""
    source = bf16_llama(tmp_path / "source")
    code = ("import sys\nfrom llmpress.cli import main\n"
            f"assert main(['oneshot', '--model', {str(source)!r}, '--recipe', 'FP8_DYNAMIC', '--output', {str(tmp_path / 'out')!r}]) == 0\n"
            "print(sorted(m for m in ('transformers', 'torch.distributed.tensor') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_an_mse_observer_quantizes_the_whole_weight_at_once():
    """MSE's search stops on the whole tensor's units: bands would stop it elsewhere."""
    from llmpress.quant import QuantizationArgs

    weight = torch.zeros(4096, 512, dtype=torch.bfloat16)
    mse = QuantizationArgs(num_bits=4, strategy="group", group_size=128, observer="mse")
    assert model_free_run._rows_per_band(weight, mse) == 4096
    assert model_free_run._rows_per_band(weight, QuantizationArgs(num_bits=4, strategy="group", group_size=128)) < 4096
    block = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[96, 128])
    assert model_free_run._rows_per_band(weight, block) % 96 == 0
