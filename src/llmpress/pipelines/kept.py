"""``KeptValues``: one value per calibration batch, kept from one stage of a block to the next.

Tensors whose rows match the batch's tokens (alone, or first in a tuple of Nones) are copied into
one buffer for all batches: a single allocation goes back to the system whole, where a few dozen
batch-sized ones leave glibc's heap fragmented (GPTQ on the 1024-hidden Llama of bench/gptq.py:
peak RSS 877-898 MB packed, 938-1026 MB with a copy per batch). The copy also means nothing the model does to the tensor it got back changes what is
kept: ``get`` hands out a fresh copy each time (``take``, for a value read once, the stored rows).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KeptValues"]


class KeptValues:
    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.starts = [sum(rows[:i]) for i in range(len(rows))]
        self.buffer: torch.Tensor | None = None
        self.items: list[Any] = [None] * len(rows)

    def put(self, index: int, value: Any) -> None:
        tensor, rest = (value[0], value[1:]) if _led_by_tensor(value) else (value, None)
        if self._fits(index, tensor):
            if self.buffer is None:
                self.buffer = tensor.new_empty((sum(self.rows), tensor.shape[-1]))
            start = self.starts[index]
            packed = self.buffer[start:start + self.rows[index]].view(tensor.shape)
            packed.copy_(tensor)
            value = packed if rest is None else (packed, *rest)
        self.items[index] = value

    def _fits(self, index: int, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[:-1].numel() != self.rows[index]:
            return False
        if self.buffer is None:
            return True
        return (self.buffer.dtype, self.buffer.device, self.buffer.shape[-1]) == (tensor.dtype, tensor.device, tensor.shape[-1])

    def get(self, index: int) -> Any:
        """Batch ``index``'s value, a copy of what is kept (the kept one stays as it was)."""
        value = self.items[index]
        if _led_by_tensor(value):
            return (value[0].clone(), *value[1:])
        return value.clone() if isinstance(value, torch.Tensor) else value

    def take(self, index: int) -> Any:
        """Batch ``index``'s value as kept, forgotten here (for a value read once)."""
        value, self.items[index] = self.items[index], None
        return value


def _led_by_tensor(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], torch.Tensor) and all(v is None for v in value[1:])
