"""Write a folder atomically: build it beside the target, then rename it into place."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmpress.errors import CheckpointError

__all__ = ["atomic_directory"]


@contextmanager
def atomic_directory(output_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces ``output_dir``.

    On any error (or a kill) the temporary folder is what is lost, never ``output_dir``: an
    existing checkpoint there stays whole until the new one is complete. The swap is two
    renames; between them the old folder sits beside the target as ``.NAME.old-*``.
    """
    target = Path(output_dir).absolute()
    if target.exists() and not target.is_dir():
        raise CheckpointError(
            "the output path exists and is not a folder",
            got=str(target),
            expected="a folder (new or an earlier checkpoint)",
            fix="choose another --output path",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is as readable as any folder
    for path in tmp.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
