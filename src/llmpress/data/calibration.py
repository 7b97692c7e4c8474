"""Calibration samples from whatever a user has: token-id tensors of at most ``seq_len``.

Sources: a text file (one long document, cut into ``seq_len``-token samples), a JSON-lines or
JSON file of records with a ``text`` field, a local dataset folder, ``datasets.Dataset`` or
``DatasetDict``, a Hugging Face Hub dataset id or one of llm-compressor's shortcut names
(``hub.py``: from the local cache first, with ``split`` and ``dataset_config``), a
``torch.utils.data.DataLoader``, a list of strings, or a list of token-id lists. Records are
samples of their own (truncated to ``seq_len``): ``input_ids``, text under ``text_column``,
or chat ``messages`` through the tokenizer's chat template (``records.py``), after
``preprocess`` where one is given.

Files are read as far as the samples need, never whole: a text file 1 MB at a time (cut at a
line end, or a space, so that no word is split) until it has given ``SPARE`` times the tokens
the samples take, a JSON-lines file until ``SPARE`` times the records (the samples are then
drawn from what was read; a file smaller than that is read whole, as before). A file that is
not UTF-8 is refused with the line of the first bad byte, and token ids outside the model's
vocabulary with the sample and the id.
"""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from llmpress.data.hub import SHORTCUTS, is_hub_name, load_hub_dataset
from llmpress.data.records import dataset_rows, loader_records, record_text_or_ids
from llmpress.errors import DataError, MissingDependencyError

__all__ = ["CalibrationOptions", "batch_samples", "load_calibration_samples", "load_records", "structure_batches"]


@dataclass
class CalibrationOptions:
    """How many samples of how many tokens, in which order (``num_samples=None``: all of them)."""

    num_samples: int | None = 64
    seq_len: int = 256
    shuffle: bool = True
    seed: int = 0
    #: samples per calibration forward. Small batches keep activation memory low and cost
    #: little time on CPU (bench/README.md, "Figures behind the code")
    batch_size: int = 2
    #: "layerwise" (one block at a time, bounded memory) or "basic" (the whole model per batch)
    pipeline: str = "layerwise"
    #: layerwise: inside each block, calibrate modules in the order the block calls them, each
    #: group on the outputs of the compressed ones before it (GPTQ's "true sequential"; every
    #: Linear multiplies once). It keeps, per calibration token, the attention output and the
    #: MLP's inner activation of the block in flight besides its input; False: two forwards
    #: per block, keeping only the block's input; None: module by module while that stays
    #: within 8x the block's weights (a small model on many tokens takes two passes)
    true_sequential: bool | None = None
    #: MoE layers: every expert sees every calibration token for its statistics (the layer's
    #: output still mixes only the routed experts), so a rarely routed expert does not get a
    #: near-empty Hessian; costs one expert forward per expert and token while calibrating
    calibrate_all_experts: bool = True
    #: layerwise: each block's inputs for every calibration batch, and what its module-by-module
    #: stages keep for later stages (the attention's output, the MLP's inner activations), go to
    #: files in the run's work folder (or the system's temporary folder) and are read back one
    #: batch at a time, so peak memory does not grow with the calibration set; False keeps them
    #: in memory (a little faster where memory is plenty)
    spill_activations: bool = True
    #: layerwise: where each block calibrates ("cuda", "cuda:1", "cpu"): the block moves there for
    #: its calibration and back, its inputs cross one batch at a time, so only one block's weights
    #: are on the device (a model larger than the GPU calibrates on it). None: a CUDA GPU when
    #: there is one and the model is in host memory, else where the model is
    device: str | None = None
    #: layerwise: the dtype each block calibrates in ("float32", "bfloat16", "float16"), cast for
    #: its turn and back; the model, its saved weights and scales keep theirs. None: the model's
    #: own where that is the fast path (a GPU; a CPU with bf16 units, AVX-512 BF16 or AMX, for a
    #: bf16 model), else float32 (bench/README.md, "Real checkpoints": the accuracy effect)
    compute_dtype: str | None = None
    #: a Hub dataset's split, sliced as ``datasets`` slices it ("train_sft[:512]"); for a
    #: ``DatasetDict``, which split to read (default "calibration", "train", then the first)
    split: str | None = None
    #: a Hub dataset's configuration ("main", "wikitext-2-raw-v1")
    dataset_config: str | None = None
    #: the record field that holds the text or the chat messages (default: "text", then "messages")
    text_column: str | None = None
    #: called on each record first: returns the record, its text or its token ids
    preprocess: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.pipeline not in ("layerwise", "basic"):
            raise DataError("unknown calibration pipeline", got=self.pipeline, expected="'layerwise' or 'basic'")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise DataError("unknown calibration device", got=repr(self.device), expected="'cpu', 'cuda' or 'cuda:N'") from None
        if self.compute_dtype is not None and str(self.compute_dtype).removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
            raise DataError("unknown compute dtype", got=repr(self.compute_dtype),
                            expected="'float32', 'bfloat16' or 'float16' (or None: the model's, where fast)")
        for name in ("num_samples", "seq_len", "batch_size"):
            if getattr(self, name) is not None and int(getattr(self, name)) < 1:
                raise DataError(f"{name} must be at least 1", got=getattr(self, name), expected=">= 1")


SPARE = 4  # a file is read until it gives this many times what the samples take
_TEXT_CHUNK = 1 << 20  # bytes of a text file read and tokenized at a time


def load_calibration_samples(source: Any, tokenizer: Any, options: CalibrationOptions,
                             vocab_size: int | None = None) -> list[torch.Tensor]:
    """A list of 1-D LongTensors, each at most ``options.seq_len`` tokens; ``vocab_size``: the
    model's, which every token id must be below."""
    samples = _load(source, tokenizer, options)
    if vocab_size is not None:
        for i, sample in enumerate(samples):
            outside = sample[(sample < 0) | (sample >= vocab_size)]
            if outside.numel():
                raise DataError(f"calibration sample {i} has a token id outside the model's vocabulary",
                                got=int(outside[0]), expected=f"ids from 0 to {vocab_size - 1}",
                                fix="token ids must come from this model's tokenizer")
    return samples


def _load(source: Any, tokenizer: Any, options: CalibrationOptions) -> list[torch.Tensor]:
    wanted = SPARE * options.num_samples if options.num_samples else None
    if isinstance(source, str) and ("\n" in source or len(source) > _LONGEST_NAME):
        raise DataError(
            "calibration data given as a string names a file, a dataset folder or a Hub dataset; this one looks like the text itself",
            got=f"{len(source)} characters over {source.count(chr(10)) + 1} line(s), starting {source[:40]!r}",
            expected="a path or a dataset id",
            fix="pass [text] (a list of strings: each one a sample), or write the text to a .txt file (cut into --seq-len-token samples)",
        )
    if isinstance(source, str) and is_hub_name(source):
        dataset, shortcut = load_hub_dataset(source, options.dataset_config, options.split)
        render = options.preprocess or shortcut.render
        column = options.text_column or (None if render else shortcut.column)
        records = dataset_rows(dataset, wanted, options.shuffle, options.seed)
        return _from_records(records, tokenizer, options, source, column, render)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise DataError(
                "calibration data not found",
                got=str(path),
                expected="a .txt, .jsonl or .json file, or a dataset folder",
            )
        if path.is_dir():
            return _from_records(_dataset_records(path, options, wanted), tokenizer, options, str(path))
        if path.suffix in (".jsonl", ".json"):
            return _from_records(_json_records(path, options), tokenizer, options, str(path))
        return _from_ids(_text_tokens(path, tokenizer, options), options, str(path))
    if _is_hf_dataset(source) and hasattr(source, "keys"):  # a DatasetDict: one of its splits
        source = source[_split_of(source, options.split)]
    if _is_hf_dataset(source):
        return _from_records(dataset_rows(source, wanted, options.shuffle, options.seed), tokenizer, options, "dataset")
    if isinstance(source, DataLoader):
        return _from_records(loader_records(source, wanted), tokenizer, options, "DataLoader")
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)) and len(source) > 0:
        return _from_records(list(source), tokenizer, options, "list")
    raise DataError(
        "cannot read calibration data from this object",
        got=type(source).__name__ if source is not None else "nothing",
        expected="a text/JSON-lines file or dataset folder, a Hub dataset id or one of "
                 f"{', '.join(SHORTCUTS)}, a datasets.Dataset, a DataLoader, a list of strings or of token-id lists",
    )


#: longer than any path a file system takes (Linux's PATH_MAX)
_LONGEST_NAME = 4096


def _split_of(splits: Any, wanted: str | None) -> str:
    names = list(splits.keys())
    if wanted is not None:
        base = wanted.split("[")[0]
        if base not in names:
            raise DataError("the calibration dataset has no such split", got=wanted, expected=names)
        return base
    return next((n for n in ("calibration", "train") if n in names), names[0])


def structure_batches(vocab: int | None, length: int = 64) -> list[torch.Tensor]:
    """One batch of seeded random token ids, for forwards that only find which modules feed
    which (``Modifier.structure_from_any_tokens``): the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab or 256, (1, length), generator=generator)]


def batch_samples(samples: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Stack runs of equal-length samples into ``[batch, seq]`` batches (no padding needed)."""
    batches, run = [], []
    for sample in samples:
        if run and (len(run) == batch_size or run[0].numel() != sample.numel()):
            batches.append(torch.stack(run))
            run = []
        run.append(sample)
    if run:
        batches.append(torch.stack(run))
    return batches


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise DataError(
            "text calibration data needs a tokenizer",
            got="no tokenizer",
            fix="pass processor=... or give a model path that has a tokenizer",
        )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _text_tokens(path: Path, tokenizer: Any, options: CalibrationOptions) -> torch.Tensor:
    """The token ids of ``path``, read a chunk at a time until there are ``SPARE`` times the
    tokens the samples take (all of them for ``num_samples=None``)."""
    wanted = SPARE * options.num_samples * options.seq_len if options.num_samples else None
    decoder = codecs.getincrementaldecoder("utf-8")()
    ids: list[int] = []
    carry, offset, lines = "", 0, 1
    with open(path, "rb") as handle:
        while wanted is None or len(ids) < wanted:
            data = handle.read(_TEXT_CHUNK)
            last = not data or not handle.peek(1)  # the end: what is left, whole (a small file in one call, as always)
            pending = len(decoder.getstate()[0])  # bytes of a character the last chunk cut, decoded with this one
            try:
                text = carry + decoder.decode(data, final=last)
            except UnicodeDecodeError as exc:
                at = max(exc.start - pending, 0)
                line = lines + data[:at].count(b"\n")
                raise DataError(f"{path} is not UTF-8 text", got=f"byte {offset + at} (line {line}) cannot be decoded",
                                expected="a UTF-8 text file", fix="convert it (iconv -t UTF-8) or remove the bad bytes") from None
            offset, lines = offset + len(data), lines + data.count(b"\n")
            if last:
                ids.extend(_tokenize(tokenizer, text) if text else [])
                break
            # a chunk ends after its last line, or before its last space (the next word keeps it)
            cut = text.rfind("\n") + 1 or max(text.rfind(" "), 0) or len(text)
            if len(text) - cut > _TEXT_CHUNK:  # no break near the end (text without spaces): cut anywhere, never carry more
                cut = len(text)
            ids.extend(_tokenize(tokenizer, text[:cut]))
            carry = text[cut:]
    return torch.tensor(ids, dtype=torch.long)


def _from_ids(ids: torch.Tensor, options: CalibrationOptions, origin: str) -> list[torch.Tensor]:
    available = ids.numel() // options.seq_len
    if available < (options.num_samples or 1):
        raise DataError(
            f"{origin} is too short for the calibration request",
            got=f"{ids.numel()} tokens = {available} samples of {options.seq_len}",
            expected=f"{options.num_samples} samples of {options.seq_len} tokens",
            fix="lower --num-samples or --seq-len, or give a longer text",
        )
    windows = list(ids[: available * options.seq_len].reshape(available, options.seq_len))
    return _choose(windows, options)


def _from_records(records: list[Any], tokenizer: Any, options: CalibrationOptions, origin: str, column: str | None = None,
                  preprocess: Callable[[Any], Any] | None = None) -> list[torch.Tensor]:
    samples = []
    column, preprocess = options.text_column or column, options.preprocess or preprocess
    for i, record in enumerate(records):
        record = record_text_or_ids(record, i, origin, tokenizer, column, preprocess)
        if isinstance(record, str):
            ids = _tokenize(tokenizer, record)
        elif isinstance(record, torch.Tensor):
            ids = record.reshape(-1).tolist()
        elif isinstance(record, Sequence) and all(isinstance(t, int) and -(2**63) <= t < 2**63 for t in record):
            ids = list(record)  # (ids outside the vocabulary are refused once the samples are drawn)
        else:
            raise DataError(
                f"calibration record {i} of {origin} has no text or token ids",
                got=type(record).__name__,
                expected="a string, a list of token ids, or a record with a 'text', 'messages' or 'input_ids' field",
            )
        if ids:
            samples.append(torch.tensor(ids[: options.seq_len], dtype=torch.long))
    if not samples:
        raise DataError(f"{origin} holds no calibration samples", got="0 non-empty records", expected=">= 1")
    return _choose(samples, options)


def _choose(samples: list[torch.Tensor], options: CalibrationOptions) -> list[torch.Tensor]:
    if options.shuffle:
        samples = list(samples)
        random.Random(options.seed).shuffle(samples)
    return samples[: options.num_samples]


def _json_records(path: Path, options: CalibrationOptions) -> list[Any]:
    """The records of a JSON file, or of a JSON-lines file read line by line until there are
    ``SPARE`` times the records the samples take."""
    return load_records(path, SPARE * options.num_samples if options.num_samples else None)


def load_records(path: Path, wanted: int | None = None) -> list[Any]:
    """The records of a JSON file (a list, or ``{"data": [...]}``), or the first ``wanted`` of a
    JSON-lines file (all for None), read line by line; a DataError names a bad line."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return data if isinstance(data, list) else data.get("data", [data]) if isinstance(data, dict) else [data]
        records = []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if wanted is not None and len(records) >= wanted:
                    break
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path} is not valid JSON lines", got=f"line {number}: {exc.msg}",
                                        expected="one JSON object per line with a 'text' field") from None
        return records
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON", got=str(exc), expected="a JSON list of records with a 'text' field") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text", got=str(exc), expected="a UTF-8 JSON file") from None


def _is_hf_dataset(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and hasattr(source, "column_names")


def _dataset_records(path: Path, options: CalibrationOptions, wanted: int | None) -> list[Any]:
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError(
            "reading a dataset folder needs the 'datasets' package",
            fix="pip install datasets  (or pip install 'llmpress[datasets]')",
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[_split_of(loaded, options.split)]
    return dataset_rows(loaded, wanted, options.shuffle, options.seed)
