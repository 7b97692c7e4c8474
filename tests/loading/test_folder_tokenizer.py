"""A checkpoint folder's tokenizer is read only when a run needs it (loading/tokenizer.py), and a
model read from a folder is identified by its shards, not by reading its weights (resume.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import make_tiny_llama, trained_model_dir

import llmpress
from llmpress.loading import tokenizer as tokenizers
from llmpress.loading.tokenizer import FolderTokenizer, tokenizer_files

RTN = "W4A16"


@pytest.fixture
def reads(monkeypatch):
    """How many times a tokenizer is read."""
    count = [0]
    real = tokenizers._from_pretrained

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizers, "_from_pretrained", counted)
    return count


def test_a_run_on_token_ids_copies_the_tokenizer_without_reading_it(tmp_path, reads):
    source = trained_model_dir()
    ids = [list(range(10, 42)) for _ in range(4)]
    llmpress.oneshot(source, "W4A16", ids, output_dir=tmp_path / "out")
    assert reads[0] == 0
    for path in tokenizer_files(source):
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "out"))("def f():")["input_ids"]


def test_text_is_tokenized_and_the_tokenizer_let_go(tmp_path, reads):
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    recipe = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: [Linear], ignore: [lm_head], scheme: W4A16}\n"
    llmpress.oneshot(trained_model_dir(), recipe, str(text), output_dir=tmp_path / "out",
                     calibration=llmpress.CalibrationOptions(num_samples=4, seq_len=32))
    assert reads[0] == 1
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_a_folder_tokenizer_answers_as_the_tokenizer_does(tmp_path):
    lazy = FolderTokenizer.of(trained_model_dir())
    assert "not read yet" in repr(lazy)
    real = tokenizers.read_tokenizer(trained_model_dir())
    assert lazy("import os")["input_ids"] == real("import os")["input_ids"] and len(lazy) == len(real)
    assert lazy.eos_token_id == real.eos_token_id and "read" in repr(lazy)
    lazy.save_pretrained(tmp_path / "saved")  # read: saved by transformers
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    assert FolderTokenizer.of(tmp_path / "saved") is not None
    (tmp_path / "empty").mkdir()
    assert FolderTokenizer.of(tmp_path / "empty") is None


def test_a_model_read_from_a_folder_is_identified_by_its_shards(tmp_path):
    from llmpress.pipelines.storage.resume import run_fingerprint

    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "m")
    recipe, options = llmpress.Recipe.from_any(RTN), llmpress.CalibrationOptions()
    batches = [torch.arange(16).reshape(1, 16)]
    read = llmpress.load_checkpoint(tmp_path / "m")
    first = run_fingerprint(read, recipe, batches, options, tmp_path / "m")
    assert run_fingerprint(read, recipe, batches, options, tmp_path / "m") == first
    shard = tmp_path / "m" / "model.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was written again
    assert run_fingerprint(read, recipe, batches, options, tmp_path / "m") != first
    json.loads((tmp_path / "m" / "config.json").read_text())  # the folder is untouched otherwise
