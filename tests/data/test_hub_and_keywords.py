"""Calibration data as llm-compressor's users bring it: Hub dataset ids and shortcut names read
from the local Hugging Face cache (no network), split slices, chat messages through the chat
template, a text column, a preprocessing function, a DatasetDict, a DataLoader, and oneshot's
llm-compressor keyword names."""

from __future__ import annotations

import logging

import pytest
import torch

from llmpress.data import CalibrationOptions, load_calibration_samples
from llmpress.data.keywords import from_llmcompressor_keywords
from llmpress.errors import DataError

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")


class Words:
    """A tokenizer of whitespace words (id = the word's length) with a chat template."""

    chat_template = "set"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, tokenize=False):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question number {i}"}, {"role": "assistant", "content": "a" * (i + 1)}]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """ultrachat_200k's train_sft split in the Hub cache layout (a snapshot and refs/main)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "datasets--HuggingFaceH4--ultrachat_200k"
    data = repo / "snapshots" / ("0" * 40) / "data"
    data.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    rows = {"prompt": [f"q{i}" for i in range(30)], "messages": [_messages(i) for i in range(30)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(data / "train_sft-00000-of-00001.parquet"))
    return tmp_path


@pytest.mark.parametrize("name", ["ultrachat_200k", "HuggingFaceH4/ultrachat_200k"])
def test_hub_dataset_from_the_local_cache(hub_cache, name):
    options = CalibrationOptions(num_samples=None, seq_len=64, shuffle=False, split="train_sft[:5]")
    samples = load_calibration_samples(name, Words(), options)
    assert len(samples) == 5  # the split's slice
    # <user> question number 0 <assistant> a: the chat template's words
    assert samples[0].tolist() == [6, 8, 6, 1, 11, 1]


def test_shortcut_maps_llmcompressor_split_names(hub_cache):
    """llm-compressor's ultrachat reads split 'train' as 'train_sft'."""
    samples = load_calibration_samples("ultrachat", Words(), CalibrationOptions(num_samples=3, seq_len=64, split="train[:10]"))
    assert len(samples) == 3


def test_missing_dataset_says_how_to_fetch_it(hub_cache, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline")))
    with pytest.raises(DataError, match="huggingface-cli download org/absent --repo-type dataset"):
        load_calibration_samples("org/absent", Words(), CalibrationOptions(num_samples=2))


def test_text_column_and_preprocessing_function():
    rows = datasets.Dataset.from_dict({"body": ["one two three", "four five"], "other": ["x", "y"]})
    by_column = load_calibration_samples(rows, Words(), CalibrationOptions(num_samples=None, shuffle=False, text_column="body"))
    assert [s.tolist() for s in by_column] == [[3, 3, 5], [4, 4]]
    preprocessed = load_calibration_samples(rows, Words(), CalibrationOptions(num_samples=None, shuffle=False,
                                                                               preprocess=lambda r: {"text": r["other"] * 3}))
    assert [s.tolist() for s in preprocessed] == [[3], [3]]
    with pytest.raises(DataError, match="no column 'missing'"):
        load_calibration_samples(rows, Words(), CalibrationOptions(text_column="missing"))


def test_dataset_dict_and_dataloader():
    splits = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a b"]}),
                                   "train": datasets.Dataset.from_dict({"text": ["aa bb cc"] * 4})})
    assert load_calibration_samples(splits, Words(), CalibrationOptions(num_samples=2))[0].tolist() == [2, 2, 2]  # "train"
    assert load_calibration_samples(splits, Words(), CalibrationOptions(num_samples=1, split="test"))[0].tolist() == [1, 1]
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    loader = torch.utils.data.DataLoader([{"input_ids": row, "attention_mask": (row > 0).long()} for row in ids], batch_size=2)
    samples = load_calibration_samples(loader, None, CalibrationOptions(num_samples=None, shuffle=False))
    assert [s.tolist() for s in samples] == [[5, 6, 7], [8, 9]]  # padding dropped


def test_llmcompressor_keyword_names(caplog):
    def preprocess(record):
        return record

    options, arguments = from_llmcompressor_keywords(None, {
        "num_calibration_samples": 12, "max_seq_length": 99, "splits": {"calibration": "train[:5%]"}, "dataset_config_name": "main",
        "text_column": "prompt", "preprocessing_func": preprocess, "shuffle_calibration_samples": False, "pipeline": "sequential",
        "tokenizer": "TOK", "precision": "auto", "pad_to_max_length": True}, {"processor": None, "dtype": None, "trust_remote_code": False})
    assert (options.num_samples, options.seq_len, options.split, options.dataset_config) == (12, 99, "train[:5%]", "main")
    assert (options.text_column, options.preprocess, options.shuffle, options.pipeline) == ("prompt", preprocess, False, "layerwise")
    assert arguments == {"processor": "TOK", "dtype": None, "trust_remote_code": False}
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_samples_typo'"):
        from_llmcompressor_keywords(None, {"num_samples_typo": 3}, {})
    with caplog.at_level(logging.INFO):
        from_llmcompressor_keywords(None, {"streaming": False}, {})
    assert "no effect" in caplog.text


def test_a_missing_file_is_not_taken_for_a_hub_id():
    with pytest.raises(DataError, match="calibration data not found"):
        load_calibration_samples("data/calib.txt", Words(), CalibrationOptions())


def test_the_text_itself_given_as_the_dataset_is_refused_briefly():
    """A string with lines, or longer than any path, is the text, not its name: said in a line,
    not as the operating system's "File name too long" with the whole text in it."""
    text = "def f():\n    return 1\n" * 5000
    with pytest.raises(DataError, match="looks like the text itself") as caught:
        load_calibration_samples(text, Words(), CalibrationOptions())
    assert len(str(caught.value)) < 600 and "[text]" in str(caught.value)
    with pytest.raises(DataError, match="looks like the text itself"):
        load_calibration_samples("x" * 5000, Words(), CalibrationOptions())
