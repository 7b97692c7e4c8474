"""The one save path: every preset's save -> load round trip, layout, sharding, atomicity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from helpers import REPO, checkpoint_tensors, logits, make_tiny_llama, token_batches

import llmpress
from llmpress.errors import CheckpointError
from llmpress.lifecycle.records import applied_recipe
from llmpress.quant import PRESET_SCHEMES

EXPECTED = {
    "W4A16": ("pack-quantized", {"weight_packed": torch.int32, "weight_shape": torch.int64}),
    "W4A16_ASYM": ("pack-quantized", {"weight_packed": torch.int32, "weight_zero_point": torch.int32}),
    "W8A16": ("pack-quantized", {"weight_packed": torch.int32}),
    "W8A8": ("int-quantized", {"weight": torch.int8}),
    "FP8": ("float-quantized", {"weight": torch.float8_e4m3fn, "input_scale": torch.float32}),
    "FP8_DYNAMIC": ("float-quantized", {"weight": torch.float8_e4m3fn}),
    "FP8_BLOCK": ("float-quantized", {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32}),
    "NVFP4A16": ("nvfp4-pack-quantized", {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                                          "weight_global_scale": torch.float32}),
    "NVFP4": ("nvfp4-pack-quantized", {"weight_packed": torch.uint8, "weight_global_scale": torch.float32,
                                       "input_global_scale": torch.float32}),
    "MXFP4A16": ("mxfp4-pack-quantized", {"weight_packed": torch.uint8, "weight_scale": torch.uint8}),
    "MXFP4": ("mxfp4-pack-quantized", {"weight_packed": torch.uint8, "weight_scale": torch.uint8}),
    "INT8": ("int-quantized", {"weight": torch.int8}),
    **{f"W{bits}A16": ("pack-quantized", {"weight_packed": torch.int32, "weight_shape": torch.int64}) for bits in range(2, 8)},
    # int weights with inputs quantized: unpacked int8 where vLLM reads that (W8A8, W4A8), packed where it reads only that
    **{f"W{bits}A{inputs}": ("pack-quantized", {"weight_packed": torch.int32, "weight_scale": torch.float32})
       for inputs in (8, 4) for bits in range(2, 8 if inputs == 8 else 5)},
    "W4AFP8": ("pack-quantized", {"weight_packed": torch.int32, "weight_shape": torch.int64}),
    "W4A8": ("int-quantized", {"weight": torch.int8, "weight_scale": torch.float32}),
    "MXFP8A16": ("mxfp8-quantized", {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8}),
    "MXFP8": ("mxfp8-quantized", {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8}),
    "MXFP4XFP8": ("mxfp4-pack-quantized", {"weight_packed": torch.uint8, "weight_scale": torch.uint8}),
}


def compress(preset, output_dir, **kwargs):
    model = make_tiny_llama(**kwargs)
    return llmpress.oneshot(model, preset, token_batches(), output_dir=output_dir)


@pytest.mark.parametrize("preset", list(PRESET_SCHEMES))
def test_every_preset_round_trips(preset, tmp_path):
    assert set(EXPECTED) == set(PRESET_SCHEMES)
    out = tmp_path / preset
    model = compress(preset, out)
    fmt, dtypes = EXPECTED[preset]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == fmt
    assert config["ignore"] == ["lm_head"]
    tensors = checkpoint_tensors(out)
    name = "model.layers.0.mlp.down_proj"  # 200 columns: a shorter last group of 128
    for suffix, dtype in dtypes.items():
        assert tensors[f"{name}.{suffix}"].dtype == dtype, suffix
    assert tensors["lm_head.weight"].dtype == torch.float32
    reloaded = llmpress.load_checkpoint(out)
    ids = torch.tensor(token_batches(2, 24, seed=3))
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=1e-4, atol=1e-4)


def test_weights_on_disk_are_smaller(tmp_path):
    compress("W4A16", tmp_path / "q")
    llmpress.save_checkpoint(tmp_path / "dense", make_tiny_llama())
    q_size = (tmp_path / "q" / "model.safetensors").stat().st_size
    dense_size = (tmp_path / "dense" / "model.safetensors").stat().st_size
    assert q_size < 0.75 * dense_size


def test_bias_tied_embeddings_and_bf16(tmp_path):
    model = make_tiny_llama(tie=True, bias=True).to(torch.bfloat16)
    llmpress.oneshot(model, "W4A16_ASYM", output_dir=tmp_path / "out")
    tensors = checkpoint_tensors(tmp_path / "out")
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    assert "lm_head.weight" not in tensors  # tied: stored once
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    reloaded = llmpress.load_checkpoint(tmp_path / "out", dtype=torch.bfloat16)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied again once read
    ids = torch.tensor(token_batches(1, 16))
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=2e-2, atol=2e-2)


def test_sharded_checkpoint_has_an_index_and_loads(tmp_path):
    model = compress("W8A8", tmp_path / "one")
    llmpress.save_checkpoint(tmp_path / "many", model, max_shard_size="100KB")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((tmp_path / "many" / s).exists() for s in shards)
    assert set(index["weight_map"]) == set(checkpoint_tensors(tmp_path / "one"))
    ids = torch.tensor(token_batches(1, 16))
    torch.testing.assert_close(logits(llmpress.load_checkpoint(tmp_path / "many"), ids), logits(model, ids))


def test_recipe_yaml_carries_every_stage_applied(tmp_path):
    model = make_tiny_llama()
    recipe = llmpress.Recipe.from_any({"QuantizationModifier": {"scheme": "W8A8", "targets": ["re:.*mlp.*"]}})
    llmpress.oneshot(model, recipe, output_dir=tmp_path / "a")
    first = yaml.safe_load((tmp_path / "a" / "recipe.yaml").read_text())
    assert llmpress.Recipe.from_dict(first) == recipe
    # loaded with its recipe, then compressed further: both stages are recorded
    again = llmpress.load_checkpoint(tmp_path / "a")
    llmpress.oneshot(again, {"QuantizationModifier": {"scheme": "W4A16", "targets": ["re:.*self_attn.*"]}}, output_dir=tmp_path / "b")
    stages = yaml.safe_load((tmp_path / "b" / "recipe.yaml").read_text())
    assert len(stages) == 2
    config = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision" and len(config["config_groups"]) == 2


def test_save_pretrained_goes_through_the_one_save_path(tmp_path):
    model = compress("W4A16", None)
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "recipe.yaml").exists()
    assert "model.layers.0.self_attn.q_proj.weight_packed" in checkpoint_tensors(tmp_path / "out")


def test_tokenizer_and_remote_code_are_saved(tmp_path):
    from helpers import trained_model_dir
    from transformers import AutoTokenizer

    source = tmp_path / "src"
    source.mkdir()
    (source / "modeling_custom.py").write_text("# the model's own code\n")
    model = make_tiny_llama()
    model.config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    model.config._name_or_path = str(source)
    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    llmpress.oneshot(model, "W4A16", output_dir=tmp_path / "out", processor=tokenizer)
    assert (tmp_path / "out" / "modeling_custom.py").read_text() == "# the model's own code\n"
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    compress("W4A16", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("llmpress.tensorfiles.write.TensorFileBuilder.write", broken)  # each shard file is written here
    with pytest.raises(CheckpointError, match="disk full"):
        llmpress.save_checkpoint(out, make_tiny_llama(seed=5))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import llmpress.checkpoint.save as save
    from llmpress.tensorfiles.write import TensorFileBuilder
    from helpers import make_tiny_llama
    real = TensorFileBuilder.write
    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)          # the new weights are half written...
        os.kill(os.getpid(), signal.SIGKILL)
    TensorFileBuilder.write = save_then_die
    save.save_checkpoint({out!r}, make_tiny_llama(seed=7), max_shard_size="100KB")
    """
)


@pytest.mark.slow  # a process of its own, killed mid-save
def test_a_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    model = compress("W8A8", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    script = KILL_SCRIPT.format(tests=str(REPO / "tests"), out=str(out))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ids = torch.tensor(token_batches(1, 16))
    torch.testing.assert_close(logits(llmpress.load_checkpoint(out), ids), logits(model, ids))


def test_output_path_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        llmpress.save_checkpoint(path, make_tiny_llama())


def test_shard_size_parsing():
    from llmpress.memory import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 2**30 and parse_size(10) == 10
    with pytest.raises(CheckpointError):
        parse_size("lots")


def test_reader_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a model checkpoint"):
        llmpress.load_checkpoint(tmp_path)


def test_files_are_readable(tmp_path):
    compress("W4A16", tmp_path / "out")
    assert all(os.stat(p).st_mode & 0o044 == 0o044 for p in (tmp_path / "out").iterdir())


def test_reads_a_checkpoint_written_by_llm_compressor():
    """llm-compressor 0.14's own output (tests/fixtures/README.md): same logits as transformers +
    compressed-tensors, and its recipe (with llm-compressor's extra fields) is carried forward."""
    from transformers import AutoModelForCausalLM

    folder = REPO / "tests" / "fixtures" / "llmcompressor-w4a16"
    ours = llmpress.load_checkpoint(folder)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor(token_batches(2, 16))
    a, b = logits(ours, ids), logits(theirs, ids)
    assert float((a - b).norm() / b.norm()) < 1e-2
    (modifier,) = applied_recipe(ours).modifiers
    assert type(modifier).__name__ == "GPTQModifier"
    assert modifier.config.actorder == "static"


@pytest.mark.parametrize("preset, words", [("W4A8", None), ("W8A8", None), ("W4A16", None),
                                           ("W4A4", "skips the int4 rounding"), ("W3A8", "refuses int3 weights with int8 inputs"),
                                           ("W8A16", "refuses int8 weight-only"), ("W4AFP8", "Hopper GPUs only"),
                                           ("MXFP8A16", "no kernel for NVFP4, MXFP4 or MXFP8"), ("NVFP4", "on GPUs"),
                                           ("FP8_BLOCK", "only on a CPU with AMX"), ("FP8_DYNAMIC", None)])
def test_inspect_says_where_vllm_serves_a_group_otherwise(preset, words):
    """What vLLM 0.32's CPU build did with each (bench/README.md, "Served by vLLM")."""
    from llmpress.loading.inspect import _vllm_device_limit
    from llmpress.quant.presets import preset_scheme

    said = _vllm_device_limit(preset_scheme(preset))
    assert said is None if words is None else words in said
