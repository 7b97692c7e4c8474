"""Where a checkpoint may be written: refused up front, before any work, when the output is not
a place for one.

Some outputs are mistakes whatever is in them: an empty path (an unset shell variable) or the
current directory, an existing file, the model's own folder or a folder holding it (the source
would be replaced by its compressed copy), a folder with a mount point inside. A run
(``oneshot``, ``train``, the command line: ``overwrite`` not None) also refuses an existing
folder that is not empty: one llmpress did not write (it has no ``llmpress_run.json`` record)
always, one it wrote unless ``overwrite`` (or ``resume``) says to replace it. A save on its own
(``save_checkpoint``, a Trainer's) writes into any folder and carries what else lives there over
(``atomic.py``): it never deletes or changes a file it did not write.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmpress.checkpoint.lock import mount_points, output_lock
from llmpress.errors import CheckpointError
from llmpress.version import __version__

__all__ = ["RECORD_NAME", "check_output", "claimed_output", "written_by_llmpress", "write_record"]

#: in every checkpoint llmpress writes: its version, and for a resumable run the run's fingerprint
RECORD_NAME = "llmpress_run.json"


def write_record(folder: Path, **fields: object) -> None:
    (folder / RECORD_NAME).write_text(json.dumps({"llmpress": __version__, **fields}, indent=1), encoding="utf-8")


def written_by_llmpress(folder: Path) -> bool:
    """Whether ``folder`` holds llmpress's record of writing it, or holds only checkpoints that
    do (what a ``train`` run killed after its earlier stages left: ``OUT/<stage>``) and the
    temporary folders of killed saves."""
    if _has_record(folder):
        return True
    entries = list(folder.iterdir())
    return bool(entries) and all(
        entry.is_dir() and not entry.is_symlink() and (_has_record(entry) or _KILLED_SAVE.fullmatch(entry.name) is not None)
        for entry in entries
    )


_KILLED_SAVE = re.compile(r"\..+\.tmp-[A-Za-z0-9_]+")


def _has_record(folder: Path) -> bool:
    try:
        record = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "llmpress" in record


def check_output(output_dir: str | Path, source: str | Path | None = None, overwrite: bool | None = None) -> Path:
    """``output_dir`` as an absolute path, or a ``CheckpointError`` saying why no checkpoint
    goes there; ``source``: the folder the model was read from, when there is one;
    ``overwrite``: None for a save on its own, else whether a run may replace a checkpoint
    llmpress wrote there."""
    if not str(output_dir).strip():
        raise CheckpointError("the output path is empty", got=repr(str(output_dir)), expected="a folder for the checkpoint",
                              fix="name the output folder (an unset shell variable gives an empty one)")
    target = Path(output_dir).absolute()
    if target.is_symlink():
        raise CheckpointError("the output is a symbolic link", got=f"{target} -> {os.readlink(target)}",
                              expected="a folder named by its own path", fix="name the folder the link points to, or another folder")
    where = target.resolve()
    if where == Path.cwd().resolve():
        raise CheckpointError("the output is the current directory", got=str(output_dir), expected="a folder for the checkpoint",
                              fix="name a folder for it, e.g. --output ./compressed")
    if os.path.ismount(target):
        raise CheckpointError("the output is a mount point", got=str(target), expected="a folder inside a filesystem",
                              fix="name a folder inside it: the checkpoint is built beside its output and swapped in, which a mount point cannot be")
    if target.exists() and not target.is_dir():
        raise CheckpointError("the output path exists and is not a folder", got=str(target),
                              expected="a folder (new or an earlier checkpoint)", fix="choose another output path")
    if source is not None and Path(source).is_dir():
        model = Path(source).resolve()
        if where == model or where in model.parents:
            raise CheckpointError(
                "the output would replace the model it is made from",
                got=f"output {target}, model {model}",
                expected="an output folder apart from the model's",
                fix="choose another output folder; the model stays as it is",
            )
    if target.is_dir():
        if overwrite is not None:
            _check_contents(target, overwrite)
        mounts = mount_points(target)
        if mounts:
            raise CheckpointError("the output folder holds a mount point", got=", ".join(str(m) for m in mounts[:3]),
                                  expected="a folder on one filesystem", fix="choose another output folder (llmpress never writes across a mount)")
    return target


@contextmanager
def claimed_output(output_dir: str | Path, source: str | Path | None, overwrite: bool) -> Iterator[None]:
    """A run's output while the block runs: the path checked (not "", ".", a file, the model's
    folder), then locked against a second run (``lock.py``, which clears what killed saves left),
    then what the folder holds checked against ``overwrite``."""
    check_output(output_dir, source)
    with output_lock(output_dir):
        check_output(output_dir, source, overwrite=overwrite)
        yield


def _check_contents(target: Path, overwrite: bool) -> None:
    names = sorted(p.name for p in target.iterdir())
    if not names:
        return
    if not written_by_llmpress(target):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CheckpointError("the output folder holds files llmpress did not write", got=f"{target}: {shown}",
                              expected="a new or empty folder, or a checkpoint llmpress wrote",
                              fix="choose another output folder (nothing in this one was touched)")
    if not overwrite:
        raise CheckpointError("the output folder holds a checkpoint already", got=str(target), expected="a new or empty folder",
                              fix="--overwrite (overwrite=True) replaces it; --resume goes on with the run that wrote it")
