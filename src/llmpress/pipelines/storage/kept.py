"""``KeptValues``: one value per calibration batch, kept from one stage of a block to the next.

Tensors whose rows match the batch's tokens (alone, or first in a tuple of Nones) are copied into
one buffer for all batches: a single allocation goes back to the system whole, where a few dozen
batch-sized ones leave glibc's heap fragmented (a lower peak for GPTQ: ``bench/README.md``, "Figures behind the code"). The copy also
means nothing the model does to the tensor it got back changes what is kept: ``get`` hands out a
fresh copy each time (``take``, for a value read once, the stored rows).

With a ``spill`` folder, that buffer is a file there instead (a GPU's tensors go through host
memory, and come back to the GPU when read): each batch's rows are
written as they come and read back one batch at a time, so what a block's stages keep (the MLP's
inner activations of every calibration token: 185 MB a layer for the 1024-hidden Llama, 369 MB
for a 2048-hidden one) costs the process one batch of memory, not all of them. The bytes go
through the operating system's file cache, which gives them back under memory pressure.
``SpilledInputs`` keeps a block's inputs the same way.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, MutableSequence
from typing import Any

import torch

from llmpress.contract.block import rows_of
from llmpress.contract.observation import primary_input, with_primary_input

__all__ = ["KeptValues", "SpilledInputs", "close_spill_files"]

#: spill files that finished ``KeptValues`` gave back, by folder: the next one writes over them.
#: Writing into pages the file cache already holds is several times faster than into new ones,
#: and the cache then holds about one stage's values, not a stream of new files.
_FREE_FILES: dict[str, list[Any]] = {}


def _spill_file(folder: str | os.PathLike) -> Any:
    free = _FREE_FILES.get(os.fspath(folder))
    return free.pop() if free else tempfile.TemporaryFile(dir=folder)


def close_spill_files() -> None:
    """Close (and so delete) the spill files kept for reuse: at the end of a calibration run."""
    for files in _FREE_FILES.values():
        for file in files:
            file.close()
    _FREE_FILES.clear()


class KeptValues:
    def __init__(self, rows: list[int], spill: str | os.PathLike | None = None) -> None:
        self.rows = rows
        self.starts = [sum(rows[:i]) for i in range(len(rows))]
        self.buffer: torch.Tensor | None = None
        self.items: list[Any] = [None] * len(rows)
        self.spill = spill
        self._file: Any = None  # the spill file (deleted when closed), once the first value came
        self._row: tuple[torch.dtype, int] | None = None  # what a spilled row holds

    def put(self, index: int, value: Any) -> None:
        tensor, rest = (value[0], value[1:]) if _led_by_tensor(value) else (value, None)
        if self._fits(index, tensor):
            if self.spill is not None:  # a GPU's tensor too: what a block keeps stays off the device
                self._write(index, tensor.cpu())
                self.items[index] = _Spilled(tuple(tensor.shape), rest, tensor.device)
                return
            if self.buffer is None:
                self.buffer = tensor.new_empty((sum(self.rows), tensor.shape[-1]))
            start = self.starts[index]
            packed = self.buffer[start:start + self.rows[index]].view(tensor.shape)
            packed.copy_(tensor)
            value = packed if rest is None else (packed, *rest)
        self.items[index] = value

    def _write(self, index: int, tensor: torch.Tensor) -> None:
        if self._file is None:
            self._file = _spill_file(self.spill)
            self._row = (tensor.dtype, tensor.shape[-1])
        raw = _bytes_of(tensor.contiguous())
        offset = self.starts[index] * tensor.shape[-1] * tensor.element_size()
        written = 0
        while written < len(raw):
            written += os.pwrite(self._file.fileno(), raw[written:], offset + written)

    def _read(self, index: int, item: _Spilled) -> Any:
        dtype, width = self._row
        tensor = torch.empty(item.shape, dtype=dtype)
        raw = _bytes_of(tensor)
        offset = self.starts[index] * width * tensor.element_size()
        done = 0
        while done < len(raw):
            count = os.preadv(self._file.fileno(), [raw[done:]], offset + done)
            if count <= 0:
                raise OSError(f"short read from the spill file of calibration batch {index}")
            done += count
        tensor = tensor.to(item.device)
        return tensor if item.rest is None else (tensor, *item.rest)

    def _fits(self, index: int, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[:-1].numel() != self.rows[index]:
            return False
        if self._row is not None:
            return self._row == (tensor.dtype, tensor.shape[-1])
        if self.buffer is None:
            return True
        return (self.buffer.dtype, self.buffer.device, self.buffer.shape[-1]) == (tensor.dtype, tensor.device, tensor.shape[-1])

    def get(self, index: int) -> Any:
        """Batch ``index``'s value, a copy of what is kept (the kept one stays as it was)."""
        value = self.items[index]
        if isinstance(value, _Spilled):
            return self._read(index, value)  # a fresh tensor already
        if _led_by_tensor(value):
            return (value[0].clone(), *value[1:])
        return value.clone() if isinstance(value, torch.Tensor) else value

    def take(self, index: int) -> Any:
        """Batch ``index``'s value as kept, forgotten here (for a value read once)."""
        value, self.items[index] = self.items[index], None
        return self._read(index, value) if isinstance(value, _Spilled) else value

    def __del__(self) -> None:
        if self._file is not None and not self._file.closed:  # for the next one to write over
            _FREE_FILES.setdefault(os.fspath(self.spill), []).append(self._file)


class _Spilled:
    """A batch's value written to the spill file: its shape, what followed it in a tuple, and the
    device it comes back to."""

    __slots__ = ("device", "rest", "shape")

    def __init__(self, shape: tuple[int, ...], rest: tuple | None, device: torch.device) -> None:
        self.shape, self.rest, self.device = shape, rest, device


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _led_by_tensor(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], torch.Tensor) and all(v is None for v in value[1:])


_PLACEHOLDER = torch.empty(0)  # where a spilled batch's hidden states were: still a tensor, so found again


class SpilledInputs(MutableSequence):
    """A block's inputs, one ``(args, kwargs)`` per calibration batch, whose hidden states (the
    large part: 64 MB for 64 x 256 tokens of a hidden-1024 model, whatever the model's depth)
    live in a spill file (``KeptValues``): reading an item reads its hidden states back, setting
    one writes them. The other arguments (rotary tables, masks: shared by every batch,
    ``share_repeated``) stay in memory, in ``skeletons``. Items can be appended, read, set, replaced
    all at once (``inputs[:] = ...``) and cleared, not removed one by one."""

    def __init__(self, rows: list[int], spill: str | os.PathLike) -> None:
        self.values = KeptValues(rows, spill)
        self.skeletons: list[tuple[tuple, dict]] = []

    def __len__(self) -> int:
        return len(self.skeletons)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices, and IndexError past the end
        return with_primary_input(*self.skeletons[index], self.values.get(index))

    def __setitem__(self, index: Any, item: Any) -> None:
        if isinstance(index, slice):
            if index != slice(None):
                raise TypeError("SpilledInputs are replaced whole (inputs[:] = ...) or one item at a time")
            self.clear()
            self.extend(item)
            return
        index = range(len(self))[index]
        self.values.put(index, primary_input(*item))
        self.skeletons[index] = with_primary_input(*item, _PLACEHOLDER)

    def __delitem__(self, index: Any) -> None:
        raise TypeError("a block's inputs are not removed one by one")

    def clear(self) -> None:
        self.values, self.skeletons = KeptValues(self.values.rows, self.values.spill), []

    def insert(self, index: int, item: Any) -> None:
        if index != len(self):
            raise TypeError("a block's inputs are appended in batch order")
        self.skeletons.append(item)
        self[index] = item

    def extend(self, items: Iterable[Any]) -> None:
        for item in items:
            self.append(item)

    def token_rows(self) -> list[int]:
        """Tokens in each batch (``plan.tokens_per_batch``) without reading the batches back."""
        return [_rows_of(self.values.items[i]) for i in range(len(self))]


def _rows_of(item: Any) -> int:
    if isinstance(item, _Spilled):
        return torch.Size(item.shape[:-1]).numel()
    return rows_of(item[0] if _led_by_tensor(item) else item)
