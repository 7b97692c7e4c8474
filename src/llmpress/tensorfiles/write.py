"""Write a safetensors file from tensors that arrive one at a time, without holding them all.

``safetensors.torch.save_file`` takes every tensor of the file at once and copies each into a
Python ``bytes`` before it writes: a shard is in memory twice. ``TensorFileBuilder`` takes
tensors as they come, keeps up to ``hold`` bytes of them in memory and appends the rest to a
scratch file beside the target; ``write`` then writes the header and each tensor's bytes, from
memory or copied from the scratch file by the kernel (``os.copy_file_range``). The layout is the
one ``save_file`` writes (tensors in safetensors' dtype order, then by name; the JSON header
padded with spaces to a multiple of 8 bytes), so the file is byte for byte the one it would write.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from llmpress.tensorfiles.read import DTYPE_NAMES

__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "ShardedWriter", "TensorFileBuilder"]

_COPY_CHUNK = 64 << 20
#: the order ``save_file`` writes dtypes in (safetensors' own dtype ranking, highest first)
_DTYPE_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


class TensorFileBuilder:
    def __init__(self, scratch: Path, hold: int = 64 << 20) -> None:
        self.scratch, self.hold = scratch, hold
        self.held: dict[str, torch.Tensor] = {}
        self.spilled: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}  # dtype, shape, offset, size
        self.held_bytes = self.nbytes = 0
        self._file = None

    def __len__(self) -> int:
        return len(self.held) + len(self.spilled)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.held_bytes + size <= self.hold:
            self.held[name] = tensor
            self.held_bytes += size
        else:
            if self._file is None:
                self._file = open(self.scratch, "w+b")
            offset = self._file.tell()
            if size:
                self._file.write(_bytes_of(tensor))
            self.spilled[name] = (tensor.dtype, tuple(tensor.shape), offset, size)
        self.nbytes += size

    def names(self) -> list[str]:
        return [*self.held, *self.spilled]

    def write(self, path: Path, metadata: dict[str, str] | None = None) -> int:
        """Write the file (and forget the tensors); returns its tensor bytes."""
        described = {n: (t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in self.held.items()}
        described.update({n: (d, s, size) for n, (d, s, _, size) in self.spilled.items()})
        order = sorted(described, key=lambda n: (_RANK[DTYPE_NAMES[described[n][0]]], n))
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name in order:
            dtype, shape, size = described[name]
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        try:
            with open(path, "wb") as out:
                out.write(struct.pack("<Q", len(text)))
                out.write(text)
                for name in order:
                    if name in self.held:
                        tensor = self.held.pop(name)
                        if tensor.numel():
                            out.write(_bytes_of(tensor))
                    else:
                        out.flush()
                        self._copy(out, *self.spilled[name][2:])
        finally:
            self.close()
        return offset

    def _copy(self, out, offset: int, size: int) -> None:
        self._file.flush()
        source = self._file.fileno()
        while size:
            try:
                done = os.copy_file_range(source, out.fileno(), min(size, _COPY_CHUNK), offset)
            except (AttributeError, OSError):
                done = os.write(out.fileno(), os.pread(source, min(size, _COPY_CHUNK), offset))
            if not done:
                raise OSError(f"could not copy from {self.scratch}")
            offset, size = offset + done, size - done

    def close(self) -> None:
        """Forget the tensors and remove the scratch file."""
        self.held.clear()
        self.spilled.clear()
        self.held_bytes = 0
        if self._file is not None:
            self._file.close()
            self._file = None
            self.scratch.unlink(missing_ok=True)


WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class ShardedWriter:
    """A checkpoint's weights as ``transformers`` lays them out: tensors in the order they come,
    a new shard whenever the next tensor would take the current one past ``limit`` bytes, one
    ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` with their index. Each shard is a
    ``TensorFileBuilder`` holding ``hold`` bytes in memory (the rest waits in a scratch file)."""

    def __init__(self, folder: Path, limit: int, hold: int = 64 << 20) -> None:
        self.folder, self.limit, self.hold = folder, limit, hold
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.current = self._builder()

    def _builder(self) -> TensorFileBuilder:
        return TensorFileBuilder(self.folder / f".part-{len(self.parts):05d}.scratch", self.hold)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if len(self.current) and self.current.nbytes + tensor.numel() * tensor.element_size() > self.limit:
            self._flush()
        self.current.add(name, tensor)

    def _flush(self) -> None:
        path = self.folder / f".part-{len(self.parts):05d}.safetensors"
        names = self.current.names()
        self.total += self.current.write(path, {"format": "pt"})
        self.parts.append((path, names))
        self.current = self._builder()

    def finish(self) -> None:
        """Write the last shard, name the shards, write the index when there are several."""
        if len(self.current) or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            self.parts[0][0].rename(self.folder / WEIGHTS_NAME)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.parts, start=1):
            filename = f"model-{i:05d}-of-{len(self.parts):05d}.safetensors"
            path.rename(self.folder / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")

    def abort(self) -> None:
        self.current.close()
