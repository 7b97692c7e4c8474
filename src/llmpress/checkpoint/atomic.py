"""Write atomically: a folder built beside its target and renamed into place (a checkpoint), or
a file through a temporary name and a rename, hashed as it is written (a resumable run's files)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from llmpress.checkpoint.lock import mount_points
from llmpress.errors import os_failure

__all__ = ["atomic_directory", "sha256_of", "write_file"]


@contextmanager
def atomic_directory(output_dir: str | Path, replaces: Callable[[str], bool] = lambda name: True) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces ``output_dir``.

    On any error (or a kill) the temporary folder is what is lost, never ``output_dir``: an
    existing checkpoint there stays whole until the new one is complete. The swap is two
    renames; between them the old folder sits beside the target as ``.NAME.old-*``.

    Entries of the old folder that the new one does not write and that ``replaces(name)`` does
    not claim (a Trainer's ``checkpoint-*`` folders, a README) are carried into the new folder as
    hard links before the swap, so saving into a folder never deletes what else lives there.
    """
    target = Path(output_dir).absolute()  # a folder or nothing yet: ``output.check_output`` came first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is as readable as any folder
        for path in tmp.rglob("*"):  # what this save wrote (carried files keep their own modes)
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o644)
        if target.exists():
            _carry_over(target, tmp, replaces)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_failure(exc, "could not write the checkpoint folder (nothing in it was changed)") from exc
    except Exception as exc:  # a Rust library's write (a tokenizer's): its message carries the errno
        shutil.rmtree(tmp, ignore_errors=True)
        if "os error" in str(exc):
            raise os_failure(exc, "could not write the checkpoint folder (nothing in it was changed)") from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        if _exchange(tmp, target):  # one step: the output path is never missing
            old = tmp
        else:  # two renames; a kill between them leaves the old checkpoint beside (lock.clear_leftovers)
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
            os.replace(tmp, target)
        # files another process wrote into the old folder during the swap (a Trainer's other
        # ranks saving their RNG state) are carried too; hard links share the file being written
        try:
            _carry_over(old, target, replaces)
        except OSError:
            pass  # the new checkpoint is in place; a late file could not be kept
        if not mount_points(old):  # never a tree on another filesystem (one mounted since the check)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system
    or filesystem cannot, and nothing was changed."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc before glibc 2.28
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


def _carry_over(old: Path, new: Path, replaces: Callable[[str], bool]) -> None:
    for entry in old.iterdir():
        if (new / entry.name).exists() or replaces(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, copy_function=_link_or_copy, symlinks=True)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(source: str | Path, destination: str | Path) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)  # same filesystem (the temp folder is beside the target): no copy
    except OSError:
        shutil.copy2(source, destination)


class _Hashing:
    """A file opened for writing that hashes what goes through it (no second read for the hash)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.digest, self.flush = handle, hashlib.sha256(), handle.flush

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)


def write_file(path: Path, value: Any, durable: bool = False) -> str:
    """``torch.save(value)`` (or ``value`` as bytes) to ``path`` through a temporary file and a
    rename, streamed; returns the SHA-256 of what was written. ``durable`` syncs it to disk first
    (a run's progress record); files that such a record names by their hash need not be."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        stream = _Hashing(handle)
        if isinstance(value, bytes):
            stream.write(value)
        else:
            torch.save(value, stream)
        digest = stream.digest.hexdigest()
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    return digest


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes, read a few MB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
