"""llmpress: compress language models into the compressed-tensors format.

Public names: ``oneshot``, ``train``, ``TrainingOptions``, ``Session``, ``active_session``, ``save_checkpoint``, ``Recipe``,
``CalibrationOptions``, ``load``, ``read_checkpoint``, ``LlmpressConfig``, ``load_checkpoint``, ``compile_decode``,
``quantize_model_free``; modifiers in ``llmpress.modifiers``; errors in
``llmpress.errors``.

Importing the package is cheap: each name (and each subpackage, ``llmpress.quant`` say) is
imported on first use, with torch and transformers behind it (``llmpress --help`` answers at
once).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        read_checkpoint,
    )
    from llmpress.model_free import quantize_model_free
    from llmpress.pipelines.training import TrainingOptions
    from llmpress.recipe import Recipe
    from llmpress.runtime.decode import compile_decode
    from llmpress.session import Session, active_session

from llmpress.version import __version__ as __version__

_HOMES = {
    "CalibrationOptions": "llmpress.data",
    "CompressedTensorsConfig": "llmpress.loading",
    "LlmpressConfig": "llmpress.loading",
    "LlmpressError": "llmpress.errors",
    "QuantizationMethod": "llmpress.loading",
    "Quantizer": "llmpress.loading",
    "Recipe": "llmpress.recipe",
    "Session": "llmpress.session",
    "TrainingOptions": "llmpress.pipelines.training",
    "active_session": "llmpress.session",
    "compile_decode": "llmpress.runtime.decode",
    "dispatch_for_generation": "llmpress.models",
    "load": "llmpress.loading",
    "load_checkpoint": "llmpress.loading",
    "read_checkpoint": "llmpress.loading",
    "oneshot": "llmpress.entrypoints",
    "quantize_model_free": "llmpress.model_free",
    "save_checkpoint": "llmpress.checkpoint",
    "train": "llmpress.entrypoints",
}

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
    "compile_decode",
    "dispatch_for_generation",
    "errors",
    "load",
    "load_checkpoint",
    "modifiers",
    "oneshot",
    "quantize_model_free",
    "read_checkpoint",
    "save_checkpoint",
    "train",
]


def __getattr__(name: str) -> Any:
    """A public name or a subpackage, imported on first use and then kept as an attribute."""
    home = _HOMES.get(name)
    if home is None and (name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name) if home else importlib.import_module(f"{__name__}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
