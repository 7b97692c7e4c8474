"""``oneshot``: compress a model with a recipe and calibration data, in one call."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint import route_save_pretrained, save_checkpoint
from llmpress.data import CalibrationOptions, batch_samples, load_calibration_samples
from llmpress.errors import CheckpointError, MissingStateError
from llmpress.pipelines.basic import run_basic_calibration
from llmpress.pipelines.layerwise import run_layerwise_calibration
from llmpress.recipe import Recipe
from llmpress.session import Session

__all__ = ["oneshot", "load_model_and_processor"]

logger = logging.getLogger(__name__)


def load_model_and_processor(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """A causal LM (plain or compressed-tensors checkpoint) and its tokenizer, from a folder."""
    from transformers import AutoTokenizer

    from llmpress.loading import load_checkpoint

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError("model folder not found", got=str(folder), expected="a local model folder")
    model = load_checkpoint(folder, dtype=dtype)
    processor = AutoTokenizer.from_pretrained(str(folder)) if _has_tokenizer(folder) else None
    return model, processor


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _require_no_calibration(recipe: Recipe) -> None:
    for modifier in recipe.modifiers:
        if "calibration_data" in modifier.required_state():
            raise MissingStateError(
                f"{type(modifier).__name__} needs 'calibration_data': pass dataset=... to oneshot "
                "(on the command line: --dataset PATH)",
                got="no dataset",
                expected="a text or JSON-lines file, a dataset, or a list of samples",
            )


def oneshot(
    model: nn.Module | str | Path,
    recipe: Any,
    dataset: Any = None,
    *,
    output_dir: str | Path | None = None,
    processor: Any = None,
    calibration: CalibrationOptions | None = None,
    save_compressed: bool = True,
) -> nn.Module:
    """Apply ``recipe`` to ``model`` stage by stage, calibrating on ``dataset``; save to
    ``output_dir`` when given; return the compressed model.

    ``model`` is a module or a checkpoint folder (its tokenizer is loaded too when
    ``processor`` is not given). ``dataset`` is a text or JSON-lines file, a dataset folder, a
    ``datasets.Dataset``, or a list of strings or token-id lists; ``calibration`` says how many
    samples of how many tokens to take from it.
    """
    if isinstance(model, (str, Path)):
        model, loaded_processor = load_model_and_processor(model)
        processor = processor if processor is not None else loaded_processor
    recipe = Recipe.from_any(recipe)
    options = calibration or CalibrationOptions()
    if dataset is None:
        _require_no_calibration(recipe)
    batches = None
    if dataset is not None:
        samples = load_calibration_samples(dataset, processor, options)
        batches = batch_samples(samples, options.batch_size)
    model.eval()
    for stage in recipe.stages:
        logger.info("running stage %s", stage.name)
        session = Session(Recipe([stage]))
        with session:
            session.initialize(model=model, calibration_data=batches, processor=processor)
            run = run_layerwise_calibration if options.pipeline == "layerwise" else run_basic_calibration
            run(model, session, batches or [])
            session.finalize()
    route_save_pretrained(model)
    if output_dir is not None:
        save_checkpoint(output_dir, model, processor, save_compressed=save_compressed)
    return model
