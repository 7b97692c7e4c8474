"""Outputs that are mistakes whatever they hold are refused before any work, and nothing of the
model or the folder is touched: an empty path, the current directory, an existing file, the
model's own folder or a folder holding it."""

from __future__ import annotations

import hashlib

import pytest
from helpers import make_tiny_llama

import llmpress
from llmpress.cli import main
from llmpress.errors import CheckpointError


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "tiny"
    make_tiny_llama().save_pretrained(folder)

    def no_work(*args, **kwargs):
        raise AssertionError("the model was read: the output should have been refused first")

    monkeypatch.setattr("llmpress.entrypoints._read_folder", no_work)
    return folder


@pytest.mark.parametrize("output, what", [
    ("", "output path is empty"),
    (".", "current directory"),
    ("models/tiny", "replace the model"),
    ("models", "replace the model"),
    ("notes.txt", "not a folder"),
])
def test_a_mistaken_output_is_refused_before_any_work(model_dir, tmp_path, monkeypatch, output, what):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    before, around = _digests(model_dir), sorted(p.name for p in tmp_path.iterdir())
    for run in (llmpress.oneshot, llmpress.train):
        with pytest.raises(CheckpointError, match=what):
            run(str(model_dir), "W8A16", ["a few words"], output_dir=output)
    assert _digests(model_dir) == before and sorted(p.name for p in tmp_path.iterdir()) == around
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_command_says_so_in_one_line(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["oneshot", "--model", str(model_dir), "--recipe", "W8A16", "--output", ""])
    assert code != 0 and "output path is empty" in capsys.readouterr().err


def test_saving_a_model_into_the_folder_it_was_read_from_is_refused(tmp_path):
    folder = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(folder)
    before = _digests(folder)
    model = llmpress.read_checkpoint(folder, quantization_config=llmpress.LlmpressConfig(bits=8))  # saves through llmpress
    with pytest.raises(CheckpointError, match="replace the model"):
        model.save_pretrained(folder)
    with pytest.raises(CheckpointError, match="replace the model"):
        llmpress.save_checkpoint(tmp_path, model)
    assert _digests(folder) == before
    llmpress.save_checkpoint(tmp_path / "copy", model)  # anywhere else is fine
    assert (tmp_path / "copy" / "model.safetensors").is_file()
