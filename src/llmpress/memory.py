"""Give freed heap memory back to the operating system: while a model streams in, after each
layer of layer-by-layer calibration, and between modules packed for a save.

A load frees many temporaries of a few MB (unpacked integers, int32 staging for the int4 kernel).
glibc keeps such blocks in its heap (its mmap threshold grows with each large free), so the
resident size climbs well past what the model holds (an int4 load's peak: ``bench/README.md``, "Figures behind the code").
``malloc_trim(0)`` after each converted tensor returns those pages.
It is a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_memory"]


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
