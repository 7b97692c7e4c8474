"""``model.save_pretrained`` on a model llmpress touched: the one save path, and every argument
transformers accepts either carried out or refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_llama

import llmpress
from llmpress.checkpoint import route_save_pretrained
from llmpress.errors import CheckpointError
from llmpress.modifiers import QuantizationModifier


def _compressed():
    model = make_tiny_llama()
    return llmpress.oneshot(model, QuantizationModifier(scheme="W4A16", ignore=["lm_head"]))


def test_save_pretrained_writes_the_compressed_checkpoint_with_its_recipe(tmp_path):
    model = _compressed()
    model.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert "QuantizationModifier" in (tmp_path / "out" / "recipe.yaml").read_text()
    model.save_pretrained(tmp_path / "dense", save_compressed=False)
    assert json.loads((tmp_path / "dense" / "config.json").read_text())["quantization_config"]["format"] == "dense"


def test_a_session_and_a_load_route_saves_and_nothing_else_does(tmp_path):
    plain = make_tiny_llama()
    assert "save_pretrained" not in vars(plain)
    session = llmpress.Session(QuantizationModifier(scheme="W8A8", ignore=["lm_head"]))
    session.initialize(model=plain)
    assert "save_pretrained" in vars(plain)
    session.finalize()
    plain.save_pretrained(tmp_path / "out")
    assert "save_pretrained" in vars(llmpress.load(tmp_path / "out"))


def test_max_shard_size_shards(tmp_path):
    _compressed().save_pretrained(tmp_path / "out", max_shard_size="200KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("kwargs, words", [
    ({"variant": "fp16"}, "variant"),
    ({"safe_serialization": False}, "safetensors only"),
    ({"save_original_format": False}, "own layout"),
    ({"distributed_checkpoint": True}, "gathered"),
    ({"push_to_hbu": True}, "unknown argument"),
    ({"repo_id": "me/model"}, "only apply with push_to_hub"),
])
def test_arguments_llmpress_cannot_honour_are_refused(kwargs, words, tmp_path):
    with pytest.raises(CheckpointError, match=words):
        _compressed().save_pretrained(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_push_to_hub_uploads_the_written_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create", repo_id, private, exist_ok))
            return type("Url", (), {"repo_id": f"me/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, commit_message, create_pr, revision):
            calls.append(("upload", repo_id, sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir()),
                          commit_message, create_pr))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    _compressed().save_pretrained(tmp_path / "tiny-w4a16", push_to_hub=True, token="t", private=True,
                                  commit_message="int4")
    assert calls[0] == ("token", "t") and calls[1] == ("create", "tiny-w4a16", True, True)
    kind, repo, files, message, pr = calls[2]
    assert (kind, repo, message, pr) == ("upload", "me/tiny-w4a16", "int4", False)
    assert {"config.json", "model.safetensors", "recipe.yaml"} <= set(files)


def test_a_trainer_save_on_the_main_process_does_not_wait_for_other_ranks(tmp_path, monkeypatch):
    model = make_tiny_llama()
    route_save_pretrained(model)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)

    def no_barrier():
        raise AssertionError("a barrier with only the main process here would hang")

    monkeypatch.setattr(torch.distributed, "barrier", no_barrier)
    model.save_pretrained(tmp_path / "a", is_main_process=True, state_dict=None, safe_serialization=True)
    assert (tmp_path / "a" / "model.safetensors").exists()
    model.save_pretrained(tmp_path / "b", is_main_process=False)
    assert not (tmp_path / "b").exists()


def test_a_gathered_state_dict_for_a_sharded_model_is_refused(tmp_path):
    model = make_tiny_llama()
    route_save_pretrained(model)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.empty(0))  # a shard, as FSDP leaves it
    with pytest.raises(CheckpointError, match="sharded"):
        model.save_pretrained(tmp_path / "out", state_dict=whole)


def test_a_routed_model_copies_and_pickles_with_its_save_path(tmp_path):
    import copy
    import io

    model = _compressed()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert twin.save_pretrained.model is twin
    llmpress.load(_save_and_return(model, tmp_path / "a")).save_pretrained(tmp_path / "b")  # a chained call
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def _save_and_return(model, folder):
    model.save_pretrained(folder)
    return folder
