"""Calibration data from every source the issue names, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import text_path, trained_model_dir
from transformers import AutoTokenizer

from llmpress.data import CalibrationOptions, batch_samples, load_calibration_samples
from llmpress.errors import DataError


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(trained_model_dir()))


def test_text_file_is_cut_into_full_windows(tokenizer):
    options = CalibrationOptions(num_samples=16, seq_len=64)
    samples = load_calibration_samples(text_path("calibration.txt"), tokenizer, options)
    assert len(samples) == 16 and all(s.shape == (64,) for s in samples)
    again = load_calibration_samples(text_path("calibration.txt"), tokenizer, options)
    assert all(torch.equal(a, b) for a, b in zip(samples, again))  # seeded shuffle
    other = load_calibration_samples(text_path("calibration.txt"), tokenizer, CalibrationOptions(16, 64, seed=1))
    assert not all(torch.equal(a, b) for a, b in zip(samples, other))


def test_too_short_text_says_what_to_change(tmp_path, tokenizer):
    path = tmp_path / "short.txt"
    path.write_text("def f(x):\n    return x\n" * 10)
    with pytest.raises(DataError) as info:
        load_calibration_samples(path, tokenizer, CalibrationOptions(num_samples=64, seq_len=256))
    assert "too short" in str(info.value) and "--num-samples" in str(info.value)


def test_json_lines_and_json(tmp_path, tokenizer):
    records = [{"text": f"import os\nprint({i})"} for i in range(5)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records))
    samples = load_calibration_samples(jsonl, tokenizer, CalibrationOptions(num_samples=3, seq_len=8, shuffle=False))
    assert len(samples) == 3 and samples[0].tolist() == tokenizer("import os\nprint(0)", add_special_tokens=False)["input_ids"][:8]
    as_json = tmp_path / "data.json"
    as_json.write_text(json.dumps(records))
    assert len(load_calibration_samples(as_json, tokenizer, CalibrationOptions(num_samples=10))) == 5


def test_lists_of_strings_and_token_ids(tokenizer):
    strings = load_calibration_samples(["a = 1", "b = 2"], tokenizer, CalibrationOptions(shuffle=False))
    assert strings[1].tolist() == tokenizer("b = 2", add_special_tokens=False)["input_ids"]
    ids = load_calibration_samples([[1, 2, 3, 4], [5, 6]], None, CalibrationOptions(seq_len=3, shuffle=False))
    assert [s.tolist() for s in ids] == [[1, 2, 3], [5, 6]]


def test_datasets_dataset_and_folder(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": ["x = 1", "y = 2", "z = 3"]})
    assert len(load_calibration_samples(dataset, tokenizer, CalibrationOptions())) == 3
    dataset.save_to_disk(str(tmp_path / "ds"))
    assert len(load_calibration_samples(tmp_path / "ds", tokenizer, CalibrationOptions(num_samples=2))) == 2


def test_bad_sources(tmp_path, tokenizer):
    with pytest.raises(DataError, match="not found"):
        load_calibration_samples(tmp_path / "nope.txt", tokenizer, CalibrationOptions())
    with pytest.raises(DataError, match="needs a tokenizer"):
        load_calibration_samples(["text"], None, CalibrationOptions())
    with pytest.raises(DataError, match="no text or token ids"):
        load_calibration_samples([{"label": 1}], tokenizer, CalibrationOptions())
    with pytest.raises(DataError, match="at least 1"):
        CalibrationOptions(num_samples=0)


def test_batches_stack_equal_lengths_only():
    samples = [torch.arange(4), torch.arange(4), torch.arange(2), torch.arange(4)]
    shapes = [b.shape for b in batch_samples(samples, batch_size=8)]
    assert shapes == [(2, 4), (1, 2), (1, 4)]
