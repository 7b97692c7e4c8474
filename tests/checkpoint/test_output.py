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


def _foreign_folder(folder):
    folder.mkdir(parents=True)
    (folder / "model_final_weights.safetensors").write_bytes(b"weights of mine")
    (folder / "pytorch_model.bin").write_bytes(b"older weights")
    (folder / "config.json").write_text('{"mine": true}')
    return folder


def test_a_folder_of_other_files_is_never_written_into(model_dir, tmp_path, capsys):
    output = _foreign_folder(tmp_path / "out")
    before = _digests(output)
    for overwrite in (False, True):
        for run in (llmpress.oneshot, llmpress.train):
            with pytest.raises(CheckpointError, match="files llmpress did not write"):
                run(str(model_dir), "W8A16", ["a few words"], output_dir=output, overwrite=overwrite)
    code = main(["oneshot", "--model", str(model_dir), "--recipe", "W8A16", "--output", str(output), "--overwrite"])
    assert code != 0 and "did not write" in capsys.readouterr().err
    assert _digests(output) == before and sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]


def test_a_checkpoint_is_replaced_only_when_asked(tmp_path):
    source = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(source)
    output = tmp_path / "out"
    llmpress.oneshot(str(source), "W8A16", output_dir=output, return_model=False, model_free=False)
    (output / "README.md").write_text("notes of mine")  # a file of the user's, in our checkpoint
    before = _digests(output)
    with pytest.raises(CheckpointError, match="holds a checkpoint already"):
        llmpress.oneshot(str(source), "W4A16", output_dir=output, return_model=False)
    assert _digests(output) == before
    llmpress.oneshot(str(source), "W4A16", output_dir=output, return_model=False, overwrite=True)
    assert (output / "README.md").read_text() == "notes of mine"
    assert _digests(output)["model.safetensors"] != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]  # no lock, temporary or old folder left


def test_a_second_run_on_a_locked_output_is_refused_naming_the_holder(tmp_path):
    from llmpress.checkpoint.lock import output_lock

    source = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(source)
    with output_lock(tmp_path / "out"):
        with pytest.raises(CheckpointError, match=r"another llmpress run.*\"pid\": \d+"):
            llmpress.oneshot(str(source), "W8A16", output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    llmpress.oneshot(str(source), "W8A16", output_dir=tmp_path / "out", return_model=False)  # released
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_what_killed_saves_left_is_cleared_by_the_next_run(tmp_path):
    source = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(source)
    output = tmp_path / "out"
    llmpress.oneshot(str(source), "W8A16", output_dir=output, return_model=False)
    saved = _digests(output)
    output.rename(tmp_path / ".out.old-12345678")  # killed between the two renames of a swap
    (tmp_path / ".out.tmp-abcdef").mkdir()  # killed while writing
    (tmp_path / ".out.tmp-abcdef" / "model.safetensors").write_bytes(b"half")
    with pytest.raises(CheckpointError, match="holds a checkpoint already"):  # the old one is back, and kept
        llmpress.oneshot(str(source), "W4A16", output_dir=output, return_model=False)
    assert _digests(output) == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_replaced_checkpoint_is_swapped_whole(tmp_path, monkeypatch, exchange):
    from llmpress.checkpoint import atomic

    if not exchange:  # a system without renameat2: two renames
        monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    target = tmp_path / "out"
    for text in ("old", "new"):
        with atomic.atomic_directory(target) as tmp:
            (tmp / "model.safetensors").write_text(text)
    assert (target / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_mount_point_inside_the_output_is_refused(tmp_path, monkeypatch):
    import os

    output = tmp_path / "out"
    (output / "data").mkdir(parents=True)
    (output / "data" / "big.bin").write_bytes(b"on another disk")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(output / "data") or real(path))
    with pytest.raises(CheckpointError, match="mount point"):
        llmpress.save_checkpoint(output, make_tiny_llama())
    assert (output / "data" / "big.bin").read_bytes() == b"on another disk"


def test_a_save_into_a_folder_keeps_weights_that_are_not_a_checkpoints(tmp_path):
    output = _foreign_folder(tmp_path / "trainer-output")  # a save on its own (a Trainer's) carries them over
    llmpress.save_checkpoint(output, make_tiny_llama())
    assert (output / "model_final_weights.safetensors").read_bytes() == b"weights of mine"
    assert not (output / "pytorch_model.bin").exists()  # a checkpoint's own weight file: stale beside the new one


def test_a_refused_run_leaves_the_holders_lock_in_place(tmp_path):
    from llmpress.checkpoint.lock import lock_path, output_lock

    with output_lock(tmp_path / "out"):
        for _ in range(2):  # the second refusal proves the first did not remove the holder's lock
            with pytest.raises(CheckpointError, match="another llmpress run"):
                with output_lock(tmp_path / "out"):
                    pass
        assert lock_path(tmp_path / "out").exists()
    assert not lock_path(tmp_path / "out").exists()


def test_leftovers_are_matched_by_the_outputs_own_name(tmp_path):
    from llmpress.checkpoint.lock import clear_leftovers

    (tmp_path / ".run1.tmp-abc").mkdir()  # another output's save in progress
    (tmp_path / ".run[12].tmp-abc").mkdir()
    assert clear_leftovers(tmp_path / "run[12]") == ["removed .run[12].tmp-abc, left by an interrupted save"]
    assert (tmp_path / ".run1.tmp-abc").is_dir()


def test_a_train_output_killed_after_a_stage_can_be_overwritten(tmp_path):
    output = tmp_path / "out"
    llmpress.save_checkpoint(output / "stage_one", make_tiny_llama())  # what a killed train() leaves
    with pytest.raises(CheckpointError, match="holds a checkpoint already"):
        llmpress.oneshot(make_tiny_llama(), "W8A16", output_dir=output)
    llmpress.oneshot(make_tiny_llama(), "W8A16", output_dir=output, overwrite=True, return_model=False)
    assert (output / "model.safetensors").is_file()


def test_an_output_that_is_a_mount_point_is_refused(tmp_path, monkeypatch):
    import os

    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(tmp_path / "volume") or real(path))
    with pytest.raises(CheckpointError, match="output is a mount point"):
        llmpress.oneshot(make_tiny_llama(), "W8A16", output_dir=tmp_path / "volume")
