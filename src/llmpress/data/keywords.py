"""llm-compressor's ``oneshot`` keyword names, read as llmpress's: a script written for
llm-compressor runs with its import line changed.

``num_calibration_samples``, ``max_seq_length``, ``shuffle_calibration_samples``, ``batch_size``,
``splits``, ``dataset_config_name``, ``text_column``, ``preprocessing_func``,
``moe_calibrate_all_experts`` and ``pipeline`` become ``CalibrationOptions`` fields; ``tokenizer``,
``precision``, ``trust_remote_code_model`` and ``dataset_path`` become ``oneshot``'s own
arguments. Names that only tune llm-compressor's own machinery (its data collator, tracing,
worker counts) are accepted and have no effect (said once, at info level); any other name is a
``TypeError``, as Python gives it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from llmpress.data.calibration import CalibrationOptions
from llmpress.errors import DataError

__all__ = ["from_llmcompressor_keywords"]

logger = logging.getLogger(__name__)

_FIELDS = {
    "num_calibration_samples": "num_samples",
    "max_seq_length": "seq_len",
    "shuffle_calibration_samples": "shuffle",
    "batch_size": "batch_size",
    "dataset_config_name": "dataset_config",
    "text_column": "text_column",
    "preprocessing_func": "preprocess",
    "moe_calibrate_all_experts": "calibrate_all_experts",
}
_ARGUMENTS = {"tokenizer": "processor", "precision": "dtype", "trust_remote_code_model": "trust_remote_code", "dataset_path": "dataset"}
#: llm-compressor's pipelines -> llmpress's (its "sequential" and "independent" calibrate layer by layer, as llmpress's layerwise does)
_PIPELINES = {"basic": "basic", "sequential": "layerwise", "layer_sequential": "layerwise", "independent": "layerwise", "datafree": "layerwise"}
_NO_EFFECT = {
    "data_collator", "pad_to_max_length", "concatenate_data", "streaming", "overwrite_cache", "preprocessing_num_workers",
    "dataloader_num_workers", "min_tokens_per_module", "tracing_ignore", "sequential_targets", "sequential_offload_device",
    "sequential_targets_per_subgraph", "quantization_aware_calibration", "propagate_error", "use_loss_mask", "sequential_prefetch",
    "remove_columns", "raw_kwargs", "clear_sparse_session", "stage", "recipe_args", "model_revision", "config_name",
    "tie_word_embeddings", "log_dir", "oneshot_device", "dvc_data_repository", "cache_dir", "use_auth_token",
}


def from_llmcompressor_keywords(calibration: CalibrationOptions | None, keywords: dict[str, Any],
                                arguments: dict[str, Any]) -> tuple[CalibrationOptions | None, dict[str, Any]]:
    """``calibration`` with llm-compressor's calibration keywords applied, and ``arguments``
    (oneshot's own, as given) with its other keywords applied where they are not given."""
    unknown = sorted(set(keywords) - set(_FIELDS) - set(_ARGUMENTS) - _NO_EFFECT - {"splits", "pipeline"})
    if unknown:
        raise TypeError(f"oneshot() got an unexpected keyword argument {unknown[0]!r} (llmpress reads its own and llm-compressor's "
                        f"names: {', '.join(sorted([*_FIELDS, *_ARGUMENTS, 'splits', 'pipeline']))})")
    ignored = sorted(set(keywords) & _NO_EFFECT)
    if ignored:
        logger.info("oneshot: %s tune llm-compressor's own machinery and have no effect in llmpress", ", ".join(ignored))
    updates = {_FIELDS[k]: v for k, v in keywords.items() if k in _FIELDS and v is not None}
    if keywords.get("splits") is not None:
        updates["split"] = _one_split(keywords["splits"])
    if keywords.get("pipeline") is not None:
        if keywords["pipeline"] not in _PIPELINES:
            raise DataError("unknown calibration pipeline", got=keywords["pipeline"], expected=sorted(_PIPELINES))
        updates["pipeline"] = _PIPELINES[keywords["pipeline"]]
    if updates:
        calibration = dataclasses.replace(calibration or CalibrationOptions(), **updates)
    arguments = dict(arguments)
    for name, ours in _ARGUMENTS.items():
        value = keywords.get(name)
        if value is not None and arguments.get(ours) in (None, False):
            arguments[ours] = None if (name == "precision" and value == "auto") else value
    return calibration, arguments


def _one_split(splits: Any) -> str:
    """llm-compressor's ``splits``: a split, a list of them, or ``{"calibration": ..., "train": ...}``."""
    if isinstance(splits, str):
        return splits
    if isinstance(splits, dict) and splits:
        return splits.get("calibration") or splits.get("train") or next(iter(splits.values()))
    if isinstance(splits, (list, tuple)) and splits:
        return splits[0]
    raise DataError("splits names no split", got=repr(splits), expected="'train[:512]', a list of splits, or {'calibration': ...}")
