"""Every safetensors header is checked before anything is read: a damaged or forged shard is a
``CheckpointError`` that names the file and what is wrong, never a tensor read from the wrong
bytes (negative offsets once read 1 KB of the header as a norm weight) nor a traceback."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import make_tiny_llama
from safetensors.torch import save_file

import llmpress
from llmpress.errors import CheckpointError
from llmpress.tensorfiles.read import read_header


def _shard(path, header: dict, data: bytes = b"", length: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}}


def test_a_valid_header_reads_in_file_order(tmp_path):
    entries = read_header(_shard(tmp_path / "m.safetensors", {"b": GOOD["b"], "a": GOOD["a"], "__metadata__": {}}, bytes(24)))
    assert [e.name for e in entries] == ["a", "b"] and entries[1].dtype == torch.bfloat16


@pytest.mark.parametrize("header, data, length, what", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [-1024, -1008]}}, bytes(16), None, "no valid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(16), None, "need 16"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, bytes(16), None, "no valid data_offsets"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), None, "past the end"),
    ({"a": {"shape": [4], "data_offsets": [0, 16]}}, bytes(16), None, "dtype llmpress cannot read"),
    ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, bytes(16), None, "no valid shape"),
    ({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, bytes(16), None, "no valid shape"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
     bytes(16), None, "overlaps"),
    ({"a": "weights"}, b"", None, "no description"),
    ({"a": GOOD["a"]}, bytes(16), 1 << 40, "header length does not fit"),
])
def test_a_damaged_header_is_refused_with_what_is_wrong(tmp_path, header, data, length, what):
    path = _shard(tmp_path / "model.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=what) as caught:
        read_header(path)
    assert "model.safetensors" in str(caught.value)


@pytest.mark.parametrize("content", [b"", b"abc", b"this is a text file, not weights\n" * 4, struct.pack("<Q", 4) + b"[1]\x00"])
def test_what_is_not_a_safetensors_file_is_refused(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        read_header(path)


def test_load_and_oneshot_refuse_a_forged_shard_before_reading_it(tmp_path):
    """A checkpoint whose norm weight's offsets point into the header: refused, nothing saved."""
    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "m")
    shard = tmp_path / "m" / "model.safetensors"
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    start, stop = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [start - 10**6, stop - 10**6]
    _shard(shard, header, raw[8 + length:])
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        llmpress.load(tmp_path / "m")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        llmpress.oneshot(str(tmp_path / "m"), "W8A16", None, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_save_file_writes_passes(tmp_path):
    save_file({"x": torch.zeros(3, 5), "y": torch.ones(7, dtype=torch.int8), "z": torch.zeros(0)}, str(tmp_path / "s.safetensors"))
    assert {e.name for e in read_header(tmp_path / "s.safetensors")} == {"x", "y", "z"}
