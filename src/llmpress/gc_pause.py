"""Keep Python's cyclic garbage collector out of the way of the heavy imports and of exit.

Importing torch and transformers' model classes creates about 600,000 long-lived objects, and
the cyclic collector walks the growing heap again and again while they are made: about a fifth
of the import time (measured on a 2-core CPU: 7.4 s with it, 6.0-6.3 s without). Nothing an
import creates is garbage, so ``gc_paused`` switches the collector off around those imports and
back on (when it was on) as soon as they are done. It is process-wide state: a second thread
inside a block of its own may see the collector come back on early, never left off.

Pausing only defers part of the cost: the objects made in the pause all sit in the youngest
generation, and the collector walks them once per generation as they age (0.3 s, then 0.3 s,
then 0.4 s on that machine: about 1.2 s of an 8 s compression of the 5M-parameter test model).
A process that is llmpress's own (the ``llmpress`` command, which calls ``own_process`` before
it imports anything heavy) moves them out of the collector's sight instead: every pause there
ends with ``gc.freeze()``, so they are never walked, not even by the interpreter's last
collection at exit (``end_process`` skips finalization altogether). The price is that cyclic
garbage already made when a pause ends (about 11,000 objects, some 8 MB, of the imports) is never
freed, and ``__del__`` of objects caught in reference cycles does not run at exit: right for a
process that ends when its one command is done, wrong for a library inside someone else's
process, which is why the library alone never freezes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

__all__ = ["end_process", "gc_paused", "own_process", "owns_process"]

_owned = False  # set by own_process(): the process ends when llmpress is done


def own_process() -> None:
    """Declare the process llmpress's own (the command line): from now on each ``gc_paused``
    block freezes what exists when it ends, and so does this call."""
    global _owned
    _owned = True
    gc.freeze()


def owns_process() -> bool:
    """Whether ``own_process`` was called: the process is llmpress's own."""
    return _owned


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the previous state comes back after
    (in a process of llmpress's own, with everything made so far frozen first)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _owned:
            gc.freeze()
        if enabled:
            gc.enable()


def end_process(code: int) -> NoReturn:
    """End a process of llmpress's own once its command is done, without tearing the interpreter
    down: exit handlers run (logging's flush, the caller's own) and the standard streams are
    flushed, then the process exits at once. Finalization would otherwise free every module and
    object one at a time (about 0.25 s after a compression), for memory the operating system takes
    back whole. Where another non-daemon thread still runs, it ends the ordinary way, which waits
    for it."""
    gc.freeze()  # should the ordinary way be taken: its last collection has nothing to walk
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # no console (pythonw)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: as the interpreter does, exit with 120
            code = code or 120
    os._exit(code)
