"""A checkpoint whose files do not hold together is refused at load with what is wrong, and
``llmpress inspect --verify`` names every problem with its file (issue 42, groups 4 and 8)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import make_tiny_llama
from safetensors.torch import load_file, save_file

import llmpress
from llmpress.cli import main
from llmpress.errors import CheckpointError
from llmpress.loading.inspect import describe_checkpoint


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "tiny"
    make_tiny_llama().save_pretrained(path)
    return path


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _inspect(folder, capsys, *options):
    code = main(["inspect", str(folder), *options])
    return code, capsys.readouterr().out


def test_a_sound_checkpoint_has_no_problems(folder, capsys):
    assert describe_checkpoint(folder, verify=True)["problems"] == []
    code, out = _inspect(folder, capsys, "--verify")
    assert code == 0 and "every tensor read: no problem(s)" in out


@pytest.mark.parametrize("damage, what", [
    (lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]), "truncated"),
    (lambda f: f.write_bytes(b""), "shorter than a safetensors header"),
    (lambda f: f.write_bytes(bytes(len(f.read_bytes()))), "header is not JSON"),
    (lambda f: f.write_bytes(f.read_bytes()[:8] + b"#" + f.read_bytes()[9:]), "header is not JSON"),
    (lambda f: f.unlink(), "no .safetensors weights"),
])
def test_broken_weight_files_are_named_by_inspect_and_refused_by_load(folder, capsys, damage, what):
    damage(folder / "model.safetensors")
    code, out = _inspect(folder, capsys)
    assert code == 1 and what in out
    with pytest.raises(CheckpointError, match=what):
        llmpress.load(folder)


def test_data_only_verify_reads_zeroed_and_non_finite_tensors(folder, capsys):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert describe_checkpoint(folder)["problems"] == []  # headers alone look fine
    code, out = _inspect(folder, capsys, "--verify")
    assert code == 1 and "'model.norm.weight' holds 1 non-finite value(s)" in out
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    code, out = _inspect(folder, capsys, "--verify")
    assert code == 1 and "every tensor in it is zero" in out


def test_a_config_of_fewer_layers_than_the_weights_is_refused(folder, tmp_path):
    model = make_tiny_llama()
    model.config.num_hidden_layers = 4
    four = type(model)(model.config)
    four.save_pretrained(folder)  # 4 layers of weights
    _edit_config(folder, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match="says 2 layers; the weights hold 4"):
        llmpress.load(folder)
    with pytest.raises(CheckpointError, match="says 2 layers"):
        llmpress.oneshot(str(folder), "W8A16", output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_million_layers_in_the_config_do_not_hang_inspect(folder):
    _edit_config(folder, num_hidden_layers=1_000_000)
    start = time.perf_counter()
    problems = describe_checkpoint(folder)["problems"]
    assert time.perf_counter() - start < 10 and "says 1000000 layers; the weights hold 2" in problems[0]


def test_an_untied_head_without_weights_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert any("the weights have no lm_head" in p for p in describe_checkpoint(folder)["problems"])


def test_packed_data_that_disagrees_with_the_configs_bits_is_refused(folder, tmp_path):
    out = tmp_path / "w4"
    llmpress.oneshot(str(folder), "W4A16", output_dir=out, return_model=False)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["num_bits"] = 8
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"words wide for \d+ columns: not 8-bit"):
        llmpress.load(out)
    assert any("not 8-bit" in p for p in describe_checkpoint(out)["problems"])


def test_a_tensor_the_index_places_in_the_wrong_shard_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: tensors[k] for k in first}, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({k: tensors[k] for k in second}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in names}  # the second half misplaced
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    problems = describe_checkpoint(folder)["problems"]
    assert any(f"tensor {second[0]!r}, which the index places here, is not in it" in p for p in problems)


def test_a_base_model_or_classifier_without_lm_head_loads(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(folder, architectures=["LlamaModel"])
    assert describe_checkpoint(folder)["problems"] == []


def test_nan_weights_are_refused_when_packed_to_fp4():
    from llmpress.formats.fp4_packed import pack_fp4

    with pytest.raises(CheckpointError, match="NaN or inf"):
        pack_fp4(torch.tensor([[0.5, float("nan")]]))
