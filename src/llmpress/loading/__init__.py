"""The loading half of llmpress: ``load`` and the quantizers that plug into it (DESIGN.md §3).

Adding a method: a config class (``@register_quantization_config("name")``), a ``Quantizer``
subclass (``@register_quantizer("name")``), both in one module imported here or found through
the ``llmpress.quantizer`` entry-point group.
"""

from llmpress.loading import compressed_tensors, on_load  # noqa: F401  (registers the built-in methods)
from llmpress.loading.config import (
    CONFIGS,
    QUANTIZERS,
    CompressedTensorsConfig,
    LlmpressConfig,
    QuantizationConfig,
    QuantizationMethod,
    config_from_dict,
    register_quantization_config,
    register_quantizer,
)
from llmpress.loading.loader import load, load_checkpoint
from llmpress.loading.quantizer import Quantizer

__all__ = [
    "CONFIGS",
    "QUANTIZERS",
    "CompressedTensorsConfig",
    "LlmpressConfig",
    "QuantizationConfig",
    "QuantizationMethod",
    "Quantizer",
    "config_from_dict",
    "load",
    "load_checkpoint",
    "register_quantization_config",
    "register_quantizer",
]
