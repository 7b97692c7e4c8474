"""Stream tensors out of safetensors shards one at a time.

``safetensors.safe_open`` memory-maps the whole file, and every page a load touches then counts in
the process's resident memory until the file is closed: loading a 2 GB checkpoint shows 2 GB of
RSS even when each tensor is quantized and dropped as it arrives. Here each large tensor gets its
own private (copy-on-write) mapping of just its bytes, alive exactly as long as the tensor: a
tensor the quantizer converts and drops gives its pages back at once, and one the model keeps
(an embedding, say) costs no copy, and only the pages it touches become resident (the kernel
maps file pages in runs, far cheaper than faulting in fresh anonymous memory and copying into it).
Small tensors, reads that convert dtype, and tensors beyond a budget of live mappings (each
holds a file descriptor) use plain ``readinto``; so does Windows, where an open mapping would
block a later save into the same folder. A mapped tensor's untouched pages read the file: a
weight file truncated or rewritten in place (not replaced, as every save does) while the model
is alive changes or breaks that model. The file format (an 8-byte header length, a JSON header,
raw little-endian data) is simple and stable; the header is parsed here, tensors are read in file
order.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpress.errors import CheckpointError

__all__ = ["ShardEntry", "checkpoint_shards", "read_header", "stream_tensors"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class ShardEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    stop: int


def checkpoint_shards(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder (from its index when there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise CheckpointError("the shard index is not readable", got=f"{index}: {exc}", expected="a weight_map") from None
        files = [folder / n for n in names]
        lost = [str(f.name) for f in files if not f.is_file()]
        if lost:
            raise CheckpointError("shards named in the index are missing", got=lost[:3], expected="every file of the weight_map")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            "no .safetensors weights in the checkpoint", got=str(folder), expected="model*.safetensors",
            fix="llmpress reads safetensors checkpoints; convert .bin weights with transformers' save_pretrained",
        )
    return files


def read_header(path: Path) -> list[ShardEntry]:
    """The tensors of one shard, in file order."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise CheckpointError("a weight file is not a readable safetensors file", got=f"{path.name}: {exc}") from None
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has a dtype llmpress cannot read", got=info["dtype"], expected=sorted(_DTYPES))
        start, stop = info["data_offsets"]
        entries.append(ShardEntry(name, _DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + stop))
    return sorted(entries, key=lambda e: e.start)


_CHUNK_BYTES = 32 << 20  # converting reads go through a scratch buffer of this size
MAP_MIN_BYTES = 1 << 20  # tensors at least this large are memory-mapped rather than read


def _map_budget() -> int:
    """How many mappings may be alive at once. Each holds a duplicate of the file descriptor
    (Python's mmap keeps one until 3.13), so a quarter of the descriptor limit, at most 512.
    None at all on Windows, where open mappings would block the folder swap of a later save."""
    if os.name != "posix":
        return 0
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 512 if soft == resource.RLIM_INFINITY else max(0, min(512, soft // 4))


_MAP_BUDGET = _map_budget()
_live_maps = [0]


def _released() -> None:
    _live_maps[0] -= 1


def _mapped(fileno: int, entry: ShardEntry) -> torch.Tensor | None:
    """``entry`` as a tensor over a private mapping of its own pages (writable, copy on write),
    or None where that is not possible (misaligned data, too many mappings alive, no mmap)."""
    size = entry.stop - entry.start
    first_page = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    if (entry.start - first_page) % max(entry.dtype.itemsize, 1) or _live_maps[0] >= _MAP_BUDGET:
        return None
    try:
        region = mmap.mmap(fileno, entry.stop - first_page, offset=first_page, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    _live_maps[0] += 1
    weakref.finalize(region, _released)
    data = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=entry.start - first_page)
    return data.view(entry.dtype).reshape(entry.shape)  # the tensor keeps the mapping alive


def stream_tensors(path: Path, entries: list[ShardEntry]) -> Iterator[tuple[ShardEntry, Callable[..., torch.Tensor]]]:
    """For each tensor of ``entries`` in file order, a reader ``read(dtype=None)`` that returns it
    in its own writable CPU memory. A read into another floating dtype converts chunk by chunk,
    so an fp32 embedding loaded as bf16 never exists in fp32 in full."""
    with open(path, "rb", buffering=0) as f:

        def read_bytes(start: int, size: int, into: torch.Tensor, name: str) -> None:
            f.seek(start)
            view = memoryview(into.numpy())[:size]
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError("a weight file ends early", got=f"{path.name}: {name}", expected=f"{size} bytes")
                got += n

        for entry in entries:

            def read(dtype: torch.dtype | None = None, entry: ShardEntry = entry) -> torch.Tensor:
                size = entry.stop - entry.start
                if dtype is None or dtype == entry.dtype or not (dtype.is_floating_point and entry.dtype.is_floating_point):
                    mapped = _mapped(f.fileno(), entry) if size >= MAP_MIN_BYTES else None
                    if mapped is not None:
                        return mapped
                    buffer = torch.empty(size, dtype=torch.uint8)
                    if size:
                        read_bytes(entry.start, size, buffer, entry.name)
                    return buffer.view(entry.dtype).reshape(entry.shape)
                out = torch.empty(entry.shape, dtype=dtype).reshape(-1)
                itemsize = entry.dtype.itemsize
                per_chunk = max(1, _CHUNK_BYTES // itemsize)
                scratch = torch.empty(min(size, per_chunk * itemsize), dtype=torch.uint8)
                for first in range(0, out.numel(), per_chunk):
                    count = min(per_chunk, out.numel() - first)
                    read_bytes(entry.start + first * itemsize, count * itemsize, scratch, entry.name)
                    out[first:first + count] = scratch[: count * itemsize].view(entry.dtype)
                return out.reshape(entry.shape)

            yield entry, read
