"""Code from a model folder runs only when the user asks for it.

A checkpoint whose ``config.json`` or ``tokenizer_config.json`` has an ``auto_map`` brings its own
Python files, which transformers imports to build the model or its tokenizer. llmpress never lets
transformers ask on standard input: every call passes ``trust_remote_code`` explicitly, and a
folder that needs it without the user's ``trust_remote_code=True`` (``--trust-remote-code``) is
refused up front, naming the files that would have run.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmpress.errors import CheckpointError

__all__ = ["require_trust_for_remote_code", "remote_code_files"]


def remote_code_files(folder: Path) -> list[str]:
    """The Python files a folder's ``auto_map`` entries would run (empty when it has none)."""
    wanted = []
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError):
            continue  # unreadable here: the reader that needs it says so
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        for value in (auto_map or {}).values() if isinstance(auto_map, dict) else ():
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "." in reference:
                    wanted.append(reference.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return sorted(set(wanted))


def require_trust_for_remote_code(folder: Path, trust_remote_code: bool) -> None:
    """Refuse a folder that brings its own code unless ``trust_remote_code``."""
    files = remote_code_files(folder)
    if files and not trust_remote_code:
        raise CheckpointError(
            "this model brings its own Python code, which llmpress runs only when asked",
            got=f"{folder}: auto_map naming {', '.join(files)}",
            expected="a model transformers builds from its own code, or trust_remote_code=True",
            fix="read the files first; if you trust them, pass --trust-remote-code (trust_remote_code=True)",
        )
