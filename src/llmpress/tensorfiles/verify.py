"""What is wrong with a checkpoint's files, each problem with the file it is in.

``structural_problems`` reads headers and the config only (cheap: run at the start of every
load): weights present, shards the index names present, every header valid (``read_header``:
offsets, sizes, truncation), tensors where the index says, the layer count of ``config.json``
against the layers the weights hold, a head that is neither tied nor present, packed integer
weights against the bits their config group names. ``verify_checkpoint`` adds what needs the
data (``llmpress inspect --verify``): every tensor read, a shard whose tensors are all zero (a
file filled with zeros), non-finite values.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmpress.errors import CheckpointError
from llmpress.tensorfiles.read import ShardEntry, checkpoint_shards, read_header, stream_tensors

__all__ = ["Problem", "config_layer_count", "sound_shards", "structural_problems", "verify_checkpoint", "weight_layer_counts"]

_LAYER = re.compile(r"^(.*?)(?:^|\.)(layers|h|blocks|layer)\.(\d+)\.")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True)
class Problem:
    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def structural_problems(folder: Path) -> tuple[list[Problem], dict[Path, list[ShardEntry]]]:
    """The problems headers and config show, and the shards' entries that could be read."""
    problems: list[Problem] = []
    try:
        files = checkpoint_shards(folder)
    except CheckpointError as exc:
        return [Problem(folder.name, str(exc))], {}
    shards: dict[Path, list[ShardEntry]] = {}
    for path in files:
        try:
            shards[path] = read_header(path)
        except CheckpointError as exc:
            problems.append(Problem(path.name, str(exc)))
    problems += _index_problems(folder, shards)
    config = _config(folder)
    if config is not None:
        names = {e.name for entries in shards.values() for e in entries}
        problems += _config_problems(config, names, shards)
    return problems, shards


def sound_shards(folder: Path) -> dict[Path, list[ShardEntry]]:
    """The shards' entries, once ``structural_problems`` finds none; else a CheckpointError that
    names the first ones (a load starts here, before it builds the model the config describes)."""
    problems, shards = structural_problems(folder)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            "the checkpoint's files do not hold together", got="; ".join(map(str, problems[:3])) + more,
            expected="config.json, the index and the weight files of one checkpoint",
            fix=f"llmpress inspect --verify {folder} lists every problem",
        )
    return shards


def verify_checkpoint(folder: str | Path) -> list[Problem]:
    """Every problem of the folder's weight files, reading all of their data."""
    folder = Path(folder)
    problems, shards = structural_problems(folder)
    for path, entries in shards.items():
        zero = nonempty = 0
        try:
            for entry, read in stream_tensors(path, entries):
                tensor = read()
                if tensor.numel() == 0:
                    continue
                nonempty += 1
                raw = tensor.reshape(-1).view(torch.uint8)
                zero += int(not raw.any())
                if tensor.is_floating_point() and tensor.element_size() > 1 and not torch.isfinite(tensor).all():
                    bad = int((~torch.isfinite(tensor)).sum())
                    problems.append(Problem(path.name, f"tensor {entry.name!r} holds {bad} non-finite value(s) (NaN or inf)"))
        except CheckpointError as exc:
            problems.append(Problem(path.name, str(exc)))
            continue
        if nonempty > 1 and zero == nonempty:
            problems.append(Problem(path.name, "every tensor in it is zero (a file filled with zeros?)"))
    return problems


def config_layer_count(config: dict[str, Any]) -> int | None:
    for scope in (config, _mapping(config.get("text_config"))):
        for key in _LAYER_KEYS:
            if type(scope.get(key)) is int:
                return scope[key]
    return None


def weight_layer_counts(names: set[str]) -> dict[str, int]:
    """The numbered layers the tensor names hold, per container (``model.layers``, a vision
    tower's ``encoder.layers``): the largest index plus one."""
    indices: dict[str, int] = {}
    for name in names:
        found = _LAYER.match(name)
        if found:
            prefix = f"{found.group(1)}.{found.group(2)}".lstrip(".")
            indices[prefix] = max(indices.get(prefix, 0), int(found.group(3)) + 1)
    return indices


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _index_problems(folder: Path, shards: dict[Path, list[ShardEntry]]) -> list[Problem]:
    index = folder / "model.safetensors.index.json"
    names = Counter(e.name for entries in shards.values() for e in entries)
    problems = [Problem(folder.name, f"tensor {n!r} is in {c} weight files") for n, c in names.items() if c > 1]
    if not index.is_file():
        return problems
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    held = {e.name: path.name for path, entries in shards.items() for e in entries}
    read = {path.name for path in shards}
    for name, file in weight_map.items():
        if file in read and held.get(name) != file:
            problems.append(Problem(file, f"tensor {name!r}, which the index places here, is not in it"))
    return problems


def _config_problems(config: dict[str, Any], names: set[str], shards: dict[Path, list[ShardEntry]]) -> list[Problem]:
    problems = []
    said, held = config_layer_count(config), weight_layer_counts(names)
    extra = config.get("num_nextn_predict_layers")  # DeepSeek-V3's multi-token prediction layers follow the model's
    extra = extra if type(extra) is int else 0
    if said is not None and held and not any(count in (said, said + extra) for count in held.values()):
        prefix, count = max(held.items(), key=lambda item: item[1])
        problems.append(Problem("config.json", f"it says {said} layers; the weights hold {count} ({prefix}.0 to .{count - 1})"))
    head = any(n.startswith("lm_head.") or ".lm_head." in n for n in names)  # lm_head.weight, or packed: weight_packed, ...
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    causal = any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures)  # not a classifier, not a base model
    if causal and config.get("tie_word_embeddings") is False and names and not head \
            and any(n.endswith("embed_tokens.weight") for n in names):
        problems.append(Problem("config.json", "its head is not tied to the embeddings, and the weights have no lm_head"))
    problems += _packing_problems(config, shards)
    problems += _tied_head_problems(config, shards)
    return problems


def _tied_head_problems(config: dict[str, Any], shards: dict[Path, list[ShardEntry]]) -> list[Problem]:
    """A config that ties the head to the embeddings over a checkpoint with a head of its own
    that differs: loading would discard the trained head (a copy of the embeddings is fine)."""
    if config.get("tie_word_embeddings") is not True:
        return []
    where = {e.name: (path, e) for path, entries in shards.items() for e in entries}
    if "lm_head.weight" not in where:
        return []
    shape = where["lm_head.weight"][1].shape  # the embedding the head would be tied to has its shape
    embedding = next((n for n, (_, e) in where.items() if n.endswith("embed_tokens.weight") and e.shape == shape), None)
    if embedding is None:
        return []
    values = []
    for name in ("lm_head.weight", embedding):
        path, entry = where[name]
        values += [read() for _, read in stream_tensors(path, [entry])]
    if values[0].shape == values[1].shape and values[0].dtype == values[1].dtype and torch.equal(values[0], values[1]):
        return []
    return [Problem("config.json", "it ties the head to the embeddings, but the weights hold an lm_head.weight of its own "
                                   "that differs: loading would discard it (set tie_word_embeddings to false)")]


def _packing_problems(config: dict[str, Any], shards: dict[Path, list[ShardEntry]]) -> list[Problem]:
    """Packed integer weights (``weight_packed`` int32 beside ``weight_shape``) whose width is not
    what their config group's bits give: eight 4-bit values or four 8-bit ones to a word."""
    qcfg = _mapping(config.get("quantization_config"))
    weights = [_mapping(_mapping(g).get("weights")) for g in _mapping(qcfg.get("config_groups")).values()]
    bits = {w.get("num_bits") for w in weights if w.get("type", "int") == "int"}
    bits = {b for b in bits if type(b) is int and 0 < b <= 32}
    if not bits or qcfg.get("format") != "pack-quantized":
        return []
    problems = []
    for path, entries in shards.items():
        packed = {e.name[: -len(".weight_packed")]: e for e in entries
                  if e.name.endswith(".weight_packed") and e.dtype == torch.int32 and len(e.shape) == 2}
        shapes = [e for e in entries if e.name.endswith(".weight_shape") and e.name[: -len(".weight_shape")] in packed]
        columns_of = {e.name[: -len(".weight_shape")]: int(read().reshape(-1)[-1]) for e, read in stream_tensors(path, shapes)}
        for module, columns in columns_of.items():
            entry = packed[module]
            widths = {b: math.ceil(columns * b / 32) for b in bits}
            if entry.shape[1] not in widths.values():
                problems.append(Problem(path.name, f"{entry.name} is {entry.shape[1]} words wide for {columns} columns: "
                                        f"not {' or '.join(f'{b}-bit ({w} words)' for b, w in widths.items())} as config.json says"))
    return problems
