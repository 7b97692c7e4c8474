"""One run per output: a lock beside the output folder, held for the whole run, and what killed
saves left there cleared up by the next run that holds it.

The lock is ``.<name>.llmpress-lock`` beside the output, locked with ``flock``: the kernel
releases it when the process ends however it ends, so a killed run never blocks the next one.
The file says who holds it (process id, host, start time, command) for the refusal a second
run gets. Under ``torch.distributed`` only the main rank, the one that writes, takes it.

A save is built in ``.<name>.tmp-*`` beside the output and swapped into place
(``atomic.py``); a run killed mid-save leaves that folder, and a kill between the two renames
of a filesystem without an atomic exchange leaves the old checkpoint as ``.<name>.old-*``. The
next run, holding the lock (so no save of another run is under way), removes the first and puts
the second back where the output is missing.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmpress.errors import CheckpointError

__all__ = ["clear_leftovers", "lock_path", "output_lock"]

logger = logging.getLogger(__name__)


def lock_path(output_dir: str | Path) -> Path:
    target = Path(output_dir).absolute()
    return target.with_name(f".{target.name}.llmpress-lock")


@contextmanager
def output_lock(output_dir: str | Path, enabled: bool = True) -> Iterator[None]:
    """Hold the output's lock while the block runs (a second run is refused, naming the holder),
    after clearing what killed saves left; ``enabled=False`` (another rank) does nothing."""
    if not enabled:
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks to take
        yield
        return
    path = lock_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = _acquire(path, fcntl, output_dir)
    if handle is None:  # a filesystem without locks (NFS without lockd): the run goes on unlocked
        clear_leftovers(output_dir)
        yield
        return
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "command": " ".join(sys.argv)[:300]}))
        handle.flush()
        clear_leftovers(output_dir)
        yield
    finally:
        try:
            path.unlink(missing_ok=True)  # while still held: who opened it meanwhile finds it gone (_acquire retries)
        finally:
            handle.close()


def _acquire(path: Path, fcntl, output_dir: str | Path):
    """The lock file, open and locked; None where the filesystem cannot lock. A file unlinked by
    its last holder between our open and our lock is not the lock any more: open it again."""
    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("cannot lock %s (%s): running without a lock on the output", path, exc.strerror or exc)
                return None
            raise CheckpointError(
                "another llmpress run is writing this output",
                got=f"{Path(output_dir).absolute()} is locked by {holder}",
                expected="one run per output folder",
                fix=f"wait for that run to end, or choose another output (the lock is {path.name}, released when its process ends)",
            ) from None
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()


def clear_leftovers(output_dir: str | Path) -> list[str]:
    """Remove the temporary folders killed saves of ``output_dir`` left beside it, and put an old
    checkpoint back where a kill between two renames left the output missing; returns what was
    done, one line each. Call it only while holding the output's lock."""
    target = Path(output_dir).absolute()
    if not target.parent.is_dir():
        return []
    done = []
    name = glob.escape(target.name)  # a name with [ or * matches only itself
    olds = sorted(target.parent.glob(f".{name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():
        os.replace(olds.pop(), target)
        done.append(f"put back {target.name}, the checkpoint an interrupted save had moved aside")
    for leftover in [*target.parent.glob(f".{name}.tmp-*"), *olds]:
        if leftover.is_dir() and not leftover.is_symlink() and not mount_points(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
            done.append(f"removed {leftover.name}, left by an interrupted save")
    for line in done:
        logger.warning("%s", line)
    return done


def mount_points(folder: Path) -> list[Path]:
    """The mount points inside ``folder`` (symbolic links are not followed)."""
    found = []
    for root, dirs, _ in os.walk(folder):
        for name in list(dirs):
            path = Path(root) / name
            if os.path.ismount(path):
                found.append(path)
                dirs.remove(name)
    return found
