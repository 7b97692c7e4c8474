"""Dtypes by the names configs and users give them."""

from __future__ import annotations

import torch

from llmpress.errors import CheckpointError

__all__ = ["as_dtype", "named_dtype"]


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype ('bfloat16', 'torch.float16' or a dtype; None stays None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise CheckpointError("not a floating-point dtype", got=dtype, expected="e.g. 'float32', 'bfloat16', 'float16'")
    return value


def named_dtype(name: object, default: torch.dtype) -> torch.dtype:
    """The floating-point dtype a config's ``dtype`` (or ``torch_dtype``) value names; ``default``
    where it names none, or something that is not one."""
    try:
        return as_dtype(name or None) or default
    except CheckpointError:
        return default
