"""The smaller mistakes of issue 42's group 9, each a clear llmpress error before any work or a
correct result: an output that is a symbolic link, a tied head over a trained one, an empty
stage, input_ids given as text, eval on a JSON-lines file, a bad regular expression, a malformed
shard index."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_llama, text_path, trained_model_dir
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import llmpress
from llmpress.data import CalibrationOptions, load_calibration_samples
from llmpress.errors import CheckpointError, DataError, RecipeError
from llmpress.evaluation.report import evaluation_text
from llmpress.recipe import Recipe


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(path)
    return path


def test_an_output_that_is_a_symbolic_link_is_refused(folder, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="symbolic link"):
        llmpress.oneshot(str(folder), "W8A16", output_dir=tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "elsewhere").iterdir())


def test_a_tied_config_over_a_trained_head_is_refused(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="would discard it"):
        llmpress.load(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # a copy of the embeddings is fine
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    llmpress.load(folder)


@pytest.mark.parametrize("text, what", [
    ("quant_stage: {}\n", "has no modifiers"),
    ("quant_stage:\n  quant_modifiers: {}\n", "has no modifiers"),
    ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W4A16, targets: ['re:[unclosed']}\n", "not a valid regular expression"),
])
def test_recipes_that_would_do_nothing_or_match_nothing_are_refused(text, what):
    with pytest.raises(RecipeError, match=what):
        Recipe.from_yaml(text)


def test_input_ids_given_as_text_are_refused(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    path = tmp_path / "ids.jsonl"
    path.write_text('{"input_ids": "1 2 3 4"}\n')
    with pytest.raises(DataError, match="gives input_ids as text"):
        load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=1, seq_len=4))


def test_eval_scores_the_text_of_json_lines_records_not_the_json(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"sentence number {i}."}) for i in range(3)) + "\n")
    assert evaluation_text(path, 1000) == "sentence number 0.\n\nsentence number 1.\n\nsentence number 2."
    assert evaluation_text(text_path("evaluation.txt"), 10) == text_path("evaluation.txt").read_text()[:160]


@pytest.mark.parametrize("index", ['{"weight_map": ["a"]}', '{"weight_map": {"a": 7}}', '{"weight_map": {"a": "../x.safetensors"}}', "[1]"])
def test_a_malformed_shard_index_is_a_checkpoint_error(folder, index):
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="index is not readable"):
        llmpress.load(folder)
    assert torch.is_tensor(load_file(folder / "model.safetensors")["lm_head.weight"])
