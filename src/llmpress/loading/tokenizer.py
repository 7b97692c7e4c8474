"""A checkpoint folder's tokenizer, read when it is first used.

A compression run needs the tokenizer only to tokenize text calibration data; saving it beside
the output is a copy of its files. Reading it costs time and memory that stay for the whole run
(SmolLM2's 49k-token tokenizer: 64 MB of the process, a large-vocabulary one several times
that), so ``oneshot`` on token ids or without data never reads it, and a run that tokenized
text lets it go before calibrating (``release``). Everything else a caller asks of it (calling
it, ``apply_chat_template``, ``eos_token_id``) reads it then and answers as the tokenizer does.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from llmpress.loading.remote_code import require_trust_for_remote_code

__all__ = ["FolderTokenizer", "read_tokenizer", "tokenizer_files"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_tokenizer(folder: Path, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer, read now, or None when it has none."""
    lazy = FolderTokenizer.of(folder, trust_remote_code)
    return None if lazy is None else lazy.tokenizer


def _from_pretrained(folder: Path, trust_remote_code: bool) -> Any:
    """transformers' tokenizer of a folder that has one (``FolderTokenizer.of`` checked it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


def tokenizer_files(folder: Path) -> list[Path]:
    """The files a tokenizer is read from: its JSON and vocabulary files, sentencepiece and
    tiktoken models, chat templates, and the code of a custom tokenizer class."""
    def belongs(name: str) -> bool:
        return (name.startswith(("tokenizer", "tokenization_", "chat_template")) or name.endswith((".model", ".tiktoken"))
                or name in ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt"))

    return sorted(p for p in folder.iterdir() if p.is_file() and belongs(p.name))


class FolderTokenizer:
    """The tokenizer of ``folder``, read on first use; ``save_pretrained`` copies its files
    when it was never read (or was let go)."""

    def __init__(self, folder: Path, trust_remote_code: bool = False) -> None:
        self.folder, self.trust_remote_code = Path(folder), trust_remote_code
        self._tokenizer: Any = None

    @classmethod
    def of(cls, folder: Path, trust_remote_code: bool = False) -> FolderTokenizer | None:
        """The folder's tokenizer, or None when it has none. Remote code is checked now."""
        if not any((folder / n).exists() for n in _TOKENIZER_FILES):
            return None
        require_trust_for_remote_code(folder, trust_remote_code)
        return cls(folder, trust_remote_code)

    @property
    def tokenizer(self) -> Any:
        """The transformers tokenizer, read now if it was not yet."""
        if self._tokenizer is None:
            self._tokenizer = _from_pretrained(self.folder, self.trust_remote_code)
        return self._tokenizer

    def release(self) -> None:
        """Let the read tokenizer go (it is read again if asked for)."""
        self._tokenizer = None

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer.save_pretrained(directory, **kwargs)
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for path in tokenizer_files(self.folder):
            shutil.copy2(path, target / path.name)
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("folder", "trust_remote_code", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __repr__(self) -> str:
        return f"FolderTokenizer({str(self.folder)!r}, {'read' if self._tokenizer is not None else 'not read yet'})"
