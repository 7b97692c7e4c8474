"""A block that calibrates in another dtype than it is stored in.

On a CPU without bf16 matrix units PyTorch emulates bf16 products, several times slower than
float32 ones, and each rounds its sum to bf16. There a bf16 model's blocks calibrate in
float32 (``pipelines/storage/onload.py`` decides): ``computing_in`` casts the block's bf16 and
fp16 tensors to float32 for its turn and back when it is done. While it is cast, the dtype a
weight is *stored* in (``stored_dtype``) stays the one it came in: scales are rounded to it
before the weight is rounded with them, so the integers chosen in float32 are the ones the
bf16 checkpoint holds, and the output has the dtypes and sizes of a bf16 run.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["LOW_PRECISION", "computing_in", "stored_dtype"]

#: the storage dtypes a block is cast up from (fp8 weights, integers and float32 stay as they are)
LOW_PRECISION = (torch.bfloat16, torch.float16)

_STORED: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()


def stored_dtype(module: nn.Module) -> torch.dtype:
    """The dtype ``module``'s weight is stored in: its own, unless its block calibrates in
    another for now."""
    return _STORED.get(module) or module.weight.dtype


@contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``module``'s bf16 / fp16 parameters and buffers in ``dtype`` for the ``with`` block, then
    back in their own dtype. Parameters stay the same objects (their data changes), so what the
    modifiers hold of them stays valid; a tensor they replaced meanwhile is cast back too."""
    cast: list[tuple[nn.Module, str, bool, torch.dtype]] = []  # (owner, name, is a parameter, stored dtype)
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            if param.dtype in LOW_PRECISION and param.dtype != dtype:
                cast.append((owner, name, True, param.dtype))
                param.data = param.data.to(dtype)
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and buffer.dtype in LOW_PRECISION and buffer.dtype != dtype:
                cast.append((owner, name, False, buffer.dtype))
                owner._buffers[name] = buffer.to(dtype)
    for owner, name, is_param, stored in cast:
        if is_param and name == "weight":
            _STORED[owner] = stored
    try:
        yield
    finally:
        for owner, name, is_param, stored in cast:
            _STORED.pop(owner, None)
            tensor = getattr(owner, name, None)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype:
                continue  # gone, or replaced by a tensor in its stored dtype already
            if is_param:
                tensor.data = tensor.data.to(stored)
            else:
                owner._buffers[name] = tensor.to(stored)
