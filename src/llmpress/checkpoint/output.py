"""Where a checkpoint may be written: refused up front, before any work, when the output is not
a place for one.

A save never deletes or changes a file it did not write (``atomic.py`` carries what else lives in
the folder over), but some outputs are mistakes whatever is in them: an empty path (an unset
shell variable) or the current directory, an existing file, and the model's own folder or a
folder holding it (the source would be replaced by its compressed copy).
"""

from __future__ import annotations

from pathlib import Path

from llmpress.errors import CheckpointError

__all__ = ["check_output"]


def check_output(output_dir: str | Path, source: str | Path | None = None) -> Path:
    """``output_dir`` as an absolute path, or a ``CheckpointError`` saying why no checkpoint
    goes there; ``source``: the folder the model was read from, when there is one."""
    if not str(output_dir).strip():
        raise CheckpointError("the output path is empty", got=repr(str(output_dir)), expected="a folder for the checkpoint",
                              fix="name the output folder (an unset shell variable gives an empty one)")
    target = Path(output_dir).absolute()
    where = target.resolve()
    if where == Path.cwd().resolve():
        raise CheckpointError("the output is the current directory", got=str(output_dir), expected="a folder for the checkpoint",
                              fix="name a folder for it, e.g. --output ./compressed")
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
    return target
