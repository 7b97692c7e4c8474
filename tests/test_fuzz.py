"""Generated bad inputs (issue 42, group 6): recipes, safetensors headers, checkpoint configs and
calibration files. Each either works or ends in an llmpress error: never a traceback from
another library, never a hang (each input runs under hypothesis's deadline). About 2,500 inputs
in all, in well under a minute."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import make_tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoTokenizer

from llmpress.data import CalibrationOptions, load_calibration_samples
from llmpress.errors import LlmpressError
from llmpress.recipe import Recipe
from llmpress.tensorfiles.read import read_header, stream_tensors
from llmpress.tensorfiles.verify import structural_problems

FAST = settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# -- recipes ----------------------------------------------------------------------------------

_WORDS = ["quant_stage", "quant_modifiers", "QuantizationModifier", "GPTQModifier", "SmoothQuantModifier", "AWQModifier",
          "SparseGPTModifier", "scheme", "targets", "ignore", "config_groups", "group_0", "weights", "num_bits", "type",
          "strategy", "group_size", "symmetric", "dynamic", "block_structure", "observer", "observer_kwargs", "actorder",
          "smoothing_strength", "mappings", "sparsity", "mask_structure", "W4A16", "FP8_DYNAMIC", "NVFP4A16", "Linear",
          "lm_head", "re:.*", "int", "float", "group", "channel", "tensor", "block", "run_type", "start", "end", "x_stage"]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.integers(), st.floats(allow_nan=True),
                     st.sampled_from(_WORDS), st.text(max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                          st.dictionaries(st.sampled_from(_WORDS), inner, max_size=5)),
                       max_leaves=30)


def _recipe_like():
    modifier = st.dictionaries(st.sampled_from(_WORDS), _VALUES, max_size=6)
    group = st.dictionaries(st.sampled_from(_WORDS[2:7]), modifier, max_size=3)
    stage = st.dictionaries(st.sampled_from(["quant_modifiers", "x_modifiers", "run_type", "QuantizationModifier"]),
                            st.one_of(group, _VALUES), max_size=3)
    return st.dictionaries(st.sampled_from(["quant_stage", "x_stage", "version", "QuantizationModifier", "other"]),
                           st.one_of(stage, _VALUES), max_size=3)


@FAST
@given(_recipe_like())
def test_generated_recipes_parse_or_raise_a_recipe_error(data):
    text = json.dumps(data, allow_nan=True)
    try:
        Recipe.from_yaml(text)
    except LlmpressError:
        pass


@FAST
@given(st.text(max_size=300))
def test_generated_recipe_text_parses_or_raises_a_recipe_error(text):
    try:
        Recipe.from_yaml(text)
    except LlmpressError:
        pass


# -- safetensors headers ----------------------------------------------------------------------

_DTYPES = ["F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F64", "X9", 7, None]
_ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(_DTYPES),
    "shape": st.one_of(st.lists(st.integers(-2, 40), max_size=3), st.text(max_size=3), st.none()),
    "data_offsets": st.one_of(st.lists(st.integers(-(2**40), 2**12), min_size=0, max_size=3), st.none(), st.text(max_size=2)),
})


@settings(FAST, max_examples=800)
@given(header=st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(_ENTRY, _SCALARS), max_size=4),
       data=st.binary(max_size=600), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)), tmp=st.just(None))
def test_generated_shard_headers_read_or_raise_a_checkpoint_error(tmp_path_factory, header, data, length, tmp):
    text = json.dumps(header).encode()
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    try:
        entries = read_header(path)
        for _, read in stream_tensors(path, entries):
            read()  # whatever the header passed is inside the file
    except LlmpressError:
        pass


# -- checkpoint configs -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny"
    make_tiny_llama().save_pretrained(folder)
    return folder


def _changed_copy(source, folder, changes):
    """``source``'s checkpoint in ``folder`` (its weights linked) with ``changes`` in its config."""
    folder.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}, allow_nan=True))
    if not (folder / "model.safetensors").exists():
        (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    return folder


_CONFIG_CHANGES = st.dictionaries(
    st.sampled_from(["num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings", "num_attention_heads",
                     "quantization_config", "model_type", "architectures", "dtype", "num_key_value_heads", "text_config"]),
    st.one_of(_SCALARS, _VALUES, st.integers(0, 10**7)), max_size=4)


@settings(FAST, max_examples=300)
@given(changes=_CONFIG_CHANGES)
def test_generated_configs_are_checked_or_raise_a_checkpoint_error(tiny_folder, tmp_path_factory, changes):
    folder = _changed_copy(tiny_folder, tmp_path_factory.getbasetemp() / "fuzz-config", changes)
    try:
        structural_problems(folder)
    except LlmpressError:
        pass


# -- calibration files ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from helpers import trained_model_dir

    return AutoTokenizer.from_pretrained(str(trained_model_dir()))


_JSONISH = st.one_of(st.binary(max_size=400), _VALUES.map(lambda v: json.dumps(v, allow_nan=True).encode()),
                     st.lists(_VALUES, max_size=5).map(lambda vs: "\n".join(json.dumps(v) for v in vs).encode()))


@settings(FAST, max_examples=400)
@given(data=_JSONISH, suffix=st.sampled_from([".txt", ".jsonl", ".json"]),
       samples=st.integers(1, 4), seq_len=st.integers(1, 64))
def test_generated_calibration_files_load_or_raise_a_data_error(tokenizer, tmp_path_factory, data, suffix, samples, seq_len):
    path = tmp_path_factory.getbasetemp() / f"fuzz{suffix}"
    path.write_bytes(data)
    try:
        got = load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=samples, seq_len=seq_len), vocab_size=len(tokenizer))
    except LlmpressError:
        return
    assert all(isinstance(s, torch.Tensor) and 0 < s.numel() <= seq_len for s in got)


def test_a_real_shard_still_reads(tmp_path):
    """The generators above reach the code that accepts: a valid file passes it."""
    save_file({"a": torch.ones(2, 3)}, tmp_path / "ok.safetensors")
    assert [e.name for e in read_header(tmp_path / "ok.safetensors")] == ["a"]


@settings(FAST, max_examples=120, deadline=10_000)
@given(changes=st.dictionaries(st.sampled_from(["num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings",
                                                 "num_attention_heads", "num_key_value_heads", "intermediate_size",
                                                 "model_type", "architectures", "dtype", "quantization_config", "rope_theta"]),
                               st.one_of(_SCALARS, st.integers(0, 300), st.sampled_from(["llama", "gpt2", "mistral", "bfloat16"])),
                               max_size=3))
def test_generated_configs_load_or_raise_an_llmpress_error(tiny_folder, tmp_path_factory, changes):
    import llmpress

    folder = _changed_copy(tiny_folder, tmp_path_factory.getbasetemp() / "fuzz-load", changes)
    try:
        llmpress.read_checkpoint(folder)
    except LlmpressError:
        pass
