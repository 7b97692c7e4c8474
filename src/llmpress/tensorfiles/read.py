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

import hashlib
import json
import math
import mmap
import os
import struct
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpress.errors import CheckpointError

__all__ = ["DTYPE_NAMES", "ShardEntry", "checkpoint_shards", "read_header", "stream_tensors"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: each dtype's name in a safetensors header
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
            if not names or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in names):
                raise ValueError(f"its files must be names in the folder, got {names[:3]}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError("the shard index is not readable", got=f"{index.name}: {type(exc).__name__}: {exc}"[:300],
                                  expected='{"weight_map": {tensor: file}}') from None
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


#: the largest JSON header a shard may have (safetensors' own limit)
MAX_HEADER_BYTES = 100_000_000


def shards_identity(folder: Path) -> str:
    """What identifies a checkpoint folder's weights without reading them: each shard's name,
    size, modification time and header. (Reading a few values of every tensor instead faults in,
    with the kernel's read-around, ~0.25 MB of each: 45 MB of SmolLM2 held for the whole run.)"""
    parts = []
    for path in checkpoint_shards(folder):
        header, _ = _header_bytes(path)
        stat = path.stat()
        parts.append(f"{path.name} {stat.st_size} {stat.st_mtime_ns} {hashlib.sha256(header).hexdigest()}")
    return "\n".join(parts)


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """A shard's JSON header as bytes, and the file's size; its length checked against the file
    and ``MAX_HEADER_BYTES``."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _invalid_shard(path, "it is shorter than a safetensors header", f"{size} bytes")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise _invalid_shard(path, "its header length does not fit the file", f"{length} bytes in a file of {size}")
            return f.read(length), size
    except OSError as exc:
        raise CheckpointError("a weight file cannot be read", got=f"{path.name}: {exc}") from None


def read_header(path: Path) -> list[ShardEntry]:
    """The tensors of one shard, in file order, every entry checked against the file before
    anything is read: the header's length within the file and ``MAX_HEADER_BYTES``, a known
    dtype, a shape of non-negative integers, offsets inside the data, in order and not
    overlapping, and each tensor's bytes equal to its dtype's size times its element count."""
    raw, size = _header_bytes(path)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _invalid_shard(path, "its header is not JSON", str(exc)[:120]) from None
    if not isinstance(header, dict):
        raise _invalid_shard(path, "its header is not a JSON object", type(header).__name__)
    base = 8 + len(raw)
    entries = [_entry(path, name, info, base) for name, info in header.items() if name != "__metadata__"]
    entries.sort(key=lambda e: (e.start, e.stop))
    end = base
    for entry in entries:
        if entry.start < end:
            raise _invalid_shard(path, f"tensor {entry.name!r} overlaps the one before it", f"starts at {entry.start - base}, before {end - base}")
        end = entry.stop
    if end > size:
        raise _invalid_shard(path, "its tensors run past the end of the file (a truncated file?)", f"data up to {end}, file of {size} bytes")
    return entries


def _entry(path: Path, name: str, info: object, base: int) -> ShardEntry:
    """One header entry, checked (``read_header``)."""
    if not isinstance(info, dict):
        raise _invalid_shard(path, f"tensor {name!r} has no description", repr(info)[:80])
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise CheckpointError(f"tensor {name!r} of {path.name} has a dtype llmpress cannot read", got=repr(dtype), expected=sorted(_DTYPES))
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _invalid_shard(path, f"tensor {name!r} has no valid shape", repr(shape)[:80])
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _invalid_shard(path, f"tensor {name!r} has no valid data_offsets", repr(offsets)[:80])
    needed = _DTYPES[dtype].itemsize * math.prod(shape)
    if offsets[1] - offsets[0] != needed:
        raise _invalid_shard(path, f"tensor {name!r} has {offsets[1] - offsets[0]} bytes where its dtype and shape need {needed}",
                        f"{dtype} {shape}, data_offsets {offsets}")
    return ShardEntry(name, _DTYPES[dtype], tuple(shape), base + offsets[0], base + offsets[1])


def _invalid_shard(path: Path, what: str, got: str) -> CheckpointError:
    return CheckpointError(
        f"{path.name} is not a valid safetensors file: {what}", got=got,
        expected="a safetensors file as save_pretrained writes it (8-byte header length, JSON header, tensor data)",
        fix="re-download or re-save the checkpoint; nothing was read from it",
    )


_CHUNK_BYTES = 32 << 20  # converting reads go through a scratch buffer of this size
MAP_MIN_BYTES = 64 << 10  # tensors at least this large are memory-mapped rather than read
#: tensors under this size are mapped only while at most half the mappings are taken, so that
#: a deep model's large weights keep their mappings (SmolLM2's q/k/v/o, 0.2-0.7 MB each, read
#: into the heap were 50 MB that stayed there: bench/README.md, "Real checkpoints")
SMALL_MAP_BYTES = 1 << 20


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


def _mapped(fileno: int, entry: ShardEntry, prefetch: bool = False) -> torch.Tensor | None:
    """``entry`` as a tensor over a private mapping of its own pages (writable, copy on write),
    or None where that is not possible (misaligned data, too many mappings alive, no mmap).
    ``prefetch``: the kernel starts reading all its pages now, in the background."""
    size = entry.stop - entry.start
    first_page = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    budget = _MAP_BUDGET if size >= SMALL_MAP_BYTES else _MAP_BUDGET // 2
    if (entry.start - first_page) % max(entry.dtype.itemsize, 1) or _live_maps[0] >= budget:
        return None
    try:
        region = mmap.mmap(fileno, entry.stop - first_page, offset=first_page, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    _live_maps[0] += 1
    weakref.finalize(region, _released)
    if prefetch and hasattr(mmap, "MADV_WILLNEED"):
        region.madvise(mmap.MADV_WILLNEED)
    data = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=entry.start - first_page)
    return data.view(entry.dtype).reshape(entry.shape)  # the tensor keeps the mapping alive


def stream_tensors(path: Path, entries: list[ShardEntry], prefetch: bool = False) -> Iterator[tuple[ShardEntry, Callable[..., torch.Tensor]]]:
    """For each tensor of ``entries`` in file order, a reader ``read(dtype=None)`` that returns it
    in its own writable CPU memory. A read into another floating dtype converts chunk by chunk,
    so an fp32 embedding loaded as bf16 never exists in fp32 in full. ``prefetch``: a tensor
    mapped from the file is read ahead in the background as soon as it is mapped, for a caller
    that uses each one at once (the model-free stream: its workers no longer wait on each page
    fault; a lazy load must not, it would pull every weight into the page cache up front)."""
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
                    mapped = _mapped(f.fileno(), entry, prefetch) if size >= MAP_MIN_BYTES else None
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
