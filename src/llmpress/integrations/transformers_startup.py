"""Import transformers without scanning its model folder twice.

Importing transformers builds the table of every model class it can load lazily: it reads the
``__all__`` of about 3,300 files under ``transformers/models``. It does so twice per process.
``transformers/__init__.py`` scans the folder, and ``transformers/models/__init__.py`` scans it
again when the first model class is imported. The scan function caches its results, but the two
callers name the folder differently: one passes a ``Path`` to the folder, the other a ``str`` to
its ``__init__.py``. On a 2-core CPU the second scan costs 0.5-0.6 s of every command's start-up.

``share_model_folder_scan`` wraps the scan function once transformers is imported. A file
argument becomes its folder's ``Path``, so the second call finds the first call's result. The
result is the same as before: the scan of a file is defined as the scan of its folder. The
wrapper is only installed when transformers looks as this code expects; otherwise nothing
changes. Only the ``llmpress`` command installs it, in a process of its own (see
``gc_pause.own_process``). A library does not change another library's functions in its
user's process.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

__all__ = ["share_model_folder_scan"]


def share_model_folder_scan() -> bool:
    """Import transformers and make its second scan of ``transformers/models`` a cache hit.
    Returns whether the wrapper is installed (False when transformers' model table is already
    built, or its scan function is not the cached one this code knows)."""
    import transformers  # noqa: F401  (scans the model folder once)

    if "transformers.models" in sys.modules:
        return False  # the second scan has happened already
    try:
        from transformers.utils import import_utils
    except ImportError:
        return False
    scan = getattr(import_utils, "create_import_structure_from_path", None)
    if scan is None or getattr(scan, "_llmpress_by_folder", False) or not hasattr(scan, "cache_info"):
        return False

    @functools.wraps(scan)
    def scan_by_folder(module_path):
        path = os.fspath(module_path)
        return scan(Path(os.path.dirname(path) if os.path.isfile(path) else path))

    scan_by_folder._llmpress_by_folder = True
    import_utils.create_import_structure_from_path = scan_by_folder
    return True
