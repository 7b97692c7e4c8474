"""Calibration datasets named as llm-compressor's users name them: a Hugging Face Hub id
(``HuggingFaceH4/ultrachat_200k``) or one of llm-compressor's shortcut names (``ultrachat_200k``,
``open_platypus``, ``gsm8k``...), with a ``split`` such as ``train_sft[:512]``.

A dataset already in the local Hugging Face cache is read from there first, without the network
(``huggingface_hub``'s snapshot of the repository, its files loaded by ``datasets``); otherwise
``datasets.load_dataset`` fetches it, or finds it in its own cache (``HF_DATASETS_OFFLINE=1``).
A dataset found nowhere is a ``DataError`` that says how to fetch it.

A shortcut also says how its records become text: chat ``messages`` through the tokenizer's chat
template, a question and its answer, an instruction and its response.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpress.errors import DataError, MissingDependencyError

__all__ = ["SHORTCUTS", "Shortcut", "is_hub_name", "load_hub_dataset"]

logger = logging.getLogger(__name__)


def _instruction(record: dict[str, Any]) -> str:
    context = f"\n\n### Input:\n{record['input']}" if record.get("input") else ""
    return f"### Instruction:\n{record['instruction']}{context}\n\n### Response:\n{record.get('output', '')}"


def _question(record: dict[str, Any]) -> str:
    return f"Question: {record['question']}\nAnswer: {record.get('answer', '')}"


def _article(record: dict[str, Any]) -> str:
    return f"{record['article']}\n\nSummary: {record.get('highlights', '')}"


@dataclass(frozen=True)
class Shortcut:
    """One of llm-compressor's dataset names: its Hub repository, configuration, default split
    and how a record becomes text (None: its ``column`` holds the text or the chat messages)."""

    repo: str
    config: str | None = None
    split: str = "train"
    column: str | None = None
    render: Callable[[dict[str, Any]], str] | None = None


SHORTCUTS: dict[str, Shortcut] = {
    "ultrachat_200k": Shortcut("HuggingFaceH4/ultrachat_200k", split="train_sft", column="messages"),
    "ultrachat": Shortcut("HuggingFaceH4/ultrachat_200k", split="train_sft", column="messages"),
    "open_platypus": Shortcut("garage-bAInd/Open-Platypus", render=_instruction),
    "evolcodealpaca": Shortcut("theblackcat102/evol-codealpaca-v1", render=_instruction),
    "gsm8k": Shortcut("openai/gsm8k", config="main", render=_question),
    "cnn_dailymail": Shortcut("cnn_dailymail", config="3.0.0", render=_article),
    "wikitext": Shortcut("Salesforce/wikitext", config="wikitext-2-raw-v1"),
    "c4": Shortcut("allenai/c4", config="en"),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".parquet", ".arrow")


def is_hub_name(text: str) -> bool:
    """A shortcut name, or ``owner/name`` that is not a path on this machine (nor a file name:
    a mistyped ``data/calib.txt`` is a missing file, not a dataset id)."""
    if text in SHORTCUTS:
        return True
    return bool(_HUB_ID.match(text)) and not text.lower().endswith(_FILE_SUFFIXES) and not Path(text).exists()


def load_hub_dataset(name: str, config: str | None = None, split: str | None = None) -> tuple[Any, Shortcut]:
    """The ``datasets.Dataset`` that ``name`` (a Hub id or a shortcut) and ``split`` name, and the
    shortcut that says how its records read (a plain one for a Hub id)."""
    try:
        import datasets
        import huggingface_hub
    except ImportError:
        raise MissingDependencyError("calibration data from the Hugging Face Hub needs the 'datasets' package",
                                     fix="pip install datasets  (or pip install 'llmpress[datasets]')") from None
    shortcut = SHORTCUTS.get(name) or Shortcut(name)
    config = config or shortcut.config
    split = split or shortcut.split
    base = split.split("[")[0]
    if shortcut.split.endswith("_sft") and base in ("train", "test"):  # ultrachat's splits, as llm-compressor names them
        split = f"{base}_sft{split[len(base):]}"
    try:
        folder = huggingface_hub.snapshot_download(shortcut.repo, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the local cache (LocalEntryNotFoundError, or a cache it cannot read)
        folder = None
    try:
        if folder is not None:
            loaded = datasets.load_dataset(folder, config, split=split) if _has_configs(folder) else datasets.load_dataset(folder, split=split)
        else:
            loaded = datasets.load_dataset(shortcut.repo, config, split=split)
    except ValueError as exc:  # an unknown split or configuration
        raise DataError(f"calibration dataset {shortcut.repo} has no such split or configuration", got=f"split={split!r}, config={config!r}",
                        expected=str(exc).splitlines()[0][:300], fix="name a split it has, e.g. split='train[:512]'") from None
    except Exception as exc:  # DatasetNotFoundError, ConnectionError, OfflineModeIsEnabled, FileNotFoundError
        raise DataError(
            f"calibration dataset {shortcut.repo!r} is not in the local Hugging Face cache and could not be fetched",
            got=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
            expected="the dataset in the Hub cache (~/.cache/huggingface/hub or $HF_HOME/hub) or reachable on the Hub",
            fix=f"on a machine with network: huggingface-cli download {shortcut.repo} --repo-type dataset, then copy $HF_HOME/hub "
                "here; or save it with Dataset.save_to_disk and pass that folder",
        ) from None
    logger.info("calibration data: %s (%s, split %s), %d records", name, "local cache" if folder else "Hub", split, len(loaded))
    return loaded, shortcut


def _has_configs(folder: str) -> bool:
    """Whether a snapshot's README declares named configurations (then ``config`` picks one)."""
    readme = Path(folder) / "README.md"
    return readme.exists() and "config_name:" in readme.read_text(encoding="utf-8", errors="replace")
