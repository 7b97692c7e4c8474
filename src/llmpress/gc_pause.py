"""Keep Python's cyclic garbage collector out of the way of the heavy imports and of exit.

Importing torch and transformers' model classes creates about a million long-lived objects; the
cyclic collector walks the growing heap again and again while they are made (on this 2-core CPU,
``import torch`` plus ``LlamaForCausalLM`` took 7.4 s with it and 6.0-6.3 s without). Nothing
created by an import is garbage, so pausing the collector there loses nothing; it is switched
back on (when it was on) as soon as the import is done.

At exit the interpreter collects everything once more before tearing the modules down (~1.4 s
with torch and transformers loaded). The command line freezes the heap just before it returns,
after every file is written and closed (``gc.freeze``: the final collection skips the frozen
objects); the library never does, because the process is not its own.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["freeze_before_exit", "gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the previous state comes back after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_before_exit() -> None:
    """For a process about to end: move every tracked object out of the collector's sight, so
    the interpreter's last collection has nothing to walk."""
    gc.freeze()
