"""llmpress: compress language models into the compressed-tensors format.

Public names: ``oneshot``, ``train``, ``TrainingOptions``, ``Session``, ``active_session``, ``save_checkpoint``, ``Recipe``,
``CalibrationOptions``, ``load``, ``LlmpressConfig``, ``load_checkpoint``; modifiers in ``llmpress.modifiers``; errors in
``llmpress.errors``.
"""

from llmpress.gc_pause import gc_paused as _gc_paused

with _gc_paused():  # torch and transformers come in here: see llmpress/gc_pause.py
    from llmpress import errors, modifiers
    from llmpress.checkpoint import save_checkpoint
    from llmpress.data import CalibrationOptions
    from llmpress.entrypoints import oneshot, train
    from llmpress.errors import LlmpressError
    from llmpress.loading import (
        CompressedTensorsConfig,
        LlmpressConfig,
        QuantizationMethod,
        Quantizer,
        load,
        load_checkpoint,
    )
    from llmpress.pipelines.training import TrainingOptions
    from llmpress.recipe import Recipe
    from llmpress.session import Session, active_session

__version__ = "0.1.0"

__all__ = [
    "CalibrationOptions",
    "CompressedTensorsConfig",
    "LlmpressConfig",
    "LlmpressError",
    "QuantizationMethod",
    "Quantizer",
    "Recipe",
    "Session",
    "TrainingOptions",
    "active_session",
    "errors",
    "load",
    "load_checkpoint",
    "modifiers",
    "oneshot",
    "save_checkpoint",
    "train",
]
