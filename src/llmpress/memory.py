"""Give freed heap memory back to the operating system: while a model streams in, after each
layer of layer-by-layer calibration, and between modules packed for a save.

A load frees many temporaries of a few MB (unpacked integers, int32 staging for the int4 kernel).
glibc keeps such blocks in its heap (its mmap threshold grows with each large free), so the
resident size climbs well past what the model holds (an int4 load's peak: ``bench/README.md``, "Figures behind the code").
``malloc_trim(0)`` after each converted tensor returns those pages.
It is a no-op where glibc is not the allocator. ``parse_size`` reads the sizes users write
(``5GB``, ``500MB``, ``1GiB``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from llmpress.errors import CheckpointError, LlmpressError

__all__ = ["parse_size", "release_free_memory"]


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


def parse_size(size: int | str, error: type[LlmpressError] = CheckpointError) -> int:
    """``5GB``, ``500MB``, ``1GiB`` or a byte count, as bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise error("cannot read the size", got=size, expected="a byte count or a size like '5GB'")
