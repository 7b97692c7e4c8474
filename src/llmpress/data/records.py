"""Calibration records as llm-compressor's users hold them, read into token ids: a dict with
``input_ids`` (a tokenized dataset) or text under a column (``text`` by default), chat
``messages`` rendered through the tokenizer's chat template, the output of a preprocessing
function, or the batches of a ``torch.utils.data.DataLoader`` (padding dropped by their
``attention_mask``)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from llmpress.errors import DataError

__all__ = ["dataset_rows", "loader_records", "record_text_or_ids"]

logger = logging.getLogger(__name__)

#: columns tried, in order, when none is named: text, then chat messages
COLUMNS = ("text", "messages", "conversations")


def record_text_or_ids(record: Any, index: int, origin: str, tokenizer: Any, column: str | None,
                       preprocess: Callable[[Any], Any] | None) -> Any:
    """What one record holds: text (a str), token ids (a list or tensor), or the record itself
    where it holds neither (the caller says so)."""
    if preprocess is not None:
        record = preprocess(record)
    if not isinstance(record, dict):
        return record
    if "input_ids" in record:
        if isinstance(record["input_ids"], str):
            raise DataError(f"calibration record {index} of {origin} gives input_ids as text", got=repr(record["input_ids"])[:80],
                            expected="a list of token ids (or the text under 'text')")
        return record["input_ids"]
    names = [column] if column else [c for c in COLUMNS if c in record]
    if column and column not in record:
        raise DataError(f"calibration record {index} of {origin} has no column {column!r}", got=sorted(record)[:10],
                        expected=f"a record with {column!r}", fix="name the column that holds the text (text_column=...)")
    if not names:
        return record
    value = record[names[0]]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return chat_text(tokenizer, value)
    return value


_warned_template = [False]


def chat_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """``messages`` as the model is prompted with them: the tokenizer's chat template, or, for a
    tokenizer without one, each message on its own lines after its role (said once)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if not _warned_template[0]:
        _warned_template[0] = True
        logger.warning("the tokenizer has no chat template: calibration messages are written as '<|role|>' lines")
    return "".join(f"<|{m.get('role', 'user')}|>\n{m['content']}\n" for m in messages)


def dataset_rows(dataset: Any, wanted: int | None, shuffle: bool, seed: int) -> list[Any]:
    """The rows of a ``datasets.Dataset``: all of them, or a random ``wanted`` of a larger one
    (chosen by index, so a 200k-row split is never read whole)."""
    total = len(dataset)
    if wanted is None or wanted >= total:
        return list(dataset)
    chosen = sorted(random.Random(seed).sample(range(total), wanted)) if shuffle else range(wanted)
    return list(dataset.select(chosen))


def loader_records(loader: Iterable[Any], wanted: int | None) -> list[Any]:
    """The samples of a DataLoader's batches (a dict with ``input_ids`` and maybe
    ``attention_mask``, a tensor, or a list of records), until ``wanted`` (all for None)."""
    records: list[Any] = []
    for batch in loader:
        if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
            ids, mask = batch["input_ids"], batch.get("attention_mask")
            rows = ids.reshape(-1, ids.shape[-1])
            masks = mask.reshape(rows.shape).bool() if isinstance(mask, torch.Tensor) else None
            records += [row[masks[i]] if masks is not None else row for i, row in enumerate(rows)]
        elif isinstance(batch, torch.Tensor):
            records += list(batch.reshape(-1, batch.shape[-1]))
        elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
            records += list(batch)
        else:
            raise DataError("a calibration DataLoader gave a batch llmpress cannot read", got=type(batch).__name__,
                            expected="a dict with 'input_ids' (and 'attention_mask'), a tensor of token ids, or a list of records")
        if wanted is not None and len(records) >= wanted:
            break
    return records
