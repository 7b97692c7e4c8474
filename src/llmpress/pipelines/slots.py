"""Where module-by-module calibration keeps a block's activations between stages.

``Slots`` holds one value per calibration batch, packed into one buffer. ``BufferPool`` hands a
finished block's buffers to the next block: alike blocks keep alike activations, and a reused
buffer costs no fresh pages. A freshly allocated buffer is zero-filled by the kernel page by page
as it is first written; on a 1024-hidden Llama the attention output and the MLP's inner
activation of 16,384 tokens are ~250 MB per block, about 0.1 s of page faults each time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from llmpress.errors import UnsupportedModelError

__all__ = ["BufferPool", "Slots"]


class BufferPool:
    """Buffers of finished blocks, by shape, dtype and device, waiting for the next block.
    ``clear`` gives them back to the system; the caller does so when the blocks are done."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((shape, like.dtype, like.device))
        return free.pop() if free else like.new_empty(shape)

    def give(self, buffers: Iterable[torch.Tensor], survivors: Iterable[Any]) -> None:
        """Take back ``buffers``, except those whose memory a surviving tensor (the block's
        outputs, handed to the next block) still uses."""
        in_use = {t.untyped_storage().data_ptr() for t in _tensors(survivors)}
        for buffer in buffers:
            if buffer.untyped_storage().data_ptr() not in in_use:
                self._free.setdefault((tuple(buffer.shape), buffer.dtype, buffer.device), []).append(buffer)

    def clear(self) -> None:
        self._free.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)
        elif isinstance(value, dict):
            yield from _tensors(value.values())


class Slots:
    """A value per batch. Tensors whose rows match the batch's tokens (and tuples of one such
    tensor and Nones) are packed into one buffer: a single allocation goes back to the system
    whole, where a few dozen batch-sized ones would leave glibc's heap fragmented (on a
    1024-hidden Llama, ~250 MB more resident memory). The buffer comes from ``pool`` when one
    is given."""

    def __init__(self, rows: list[int], pool: BufferPool | None = None) -> None:
        self.rows = rows
        self.starts = [sum(rows[:i]) for i in range(len(rows))]
        self.pool = pool
        self.buffer: torch.Tensor | None = None
        self.items: list[Any] = [None] * len(rows)
        self.writes = 0  # the buffer's version counter must match: nothing else wrote into it

    def put(self, index: int, value: Any) -> None:
        tensor = value[0] if isinstance(value, tuple) and value and all(v is None for v in value[1:]) else value
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[:-1].numel() == self.rows[index]:
            if self.buffer is None:
                shape = (sum(self.rows), tensor.shape[-1])
                self.buffer = self.pool.take(shape, tensor) if self.pool is not None else tensor.new_empty(shape)
                self.writes = self.buffer._version
            if (self.buffer.dtype, self.buffer.device, self.buffer.shape[-1]) == (tensor.dtype, tensor.device, tensor.shape[-1]):
                start = self.starts[index]
                packed = self.buffer[start:start + self.rows[index]].view(tensor.shape).copy_(tensor)
                self.writes += 1
                value = packed if tensor is value else (packed, *value[1:])
        self.items[index] = value

    def __getitem__(self, index: int) -> Any:
        if self.buffer is not None and self.buffer._version != self.writes:
            raise UnsupportedModelError(
                "the block's forward changed a kept module output in place",
                got="an in-place operation on a submodule's output",
                expected="module outputs the block only reads",
                fix="calibrate this model with CalibrationOptions(true_sequential=False)",
            )
        return self.items[index]

    def take(self, index: int) -> Any:
        value = self[index]
        self.items[index] = None
        return value

    def release(self) -> torch.Tensor | None:
        """Forget the values; the buffer, if any, for the caller to pass on."""
        buffer, self.buffer = self.buffer, None
        self.items = [None] * len(self.rows)
        return buffer
