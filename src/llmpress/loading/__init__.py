"""The loading half of llmpress: ``load`` and the quantizers that plug into it.

Adding a method: a config class and a ``Quantizer`` subclass registered together with
``@register_quantization_method("name", config=NameConfig)`` (in a module imported here, or in a
plugin named in the ``llmpress.quantization_method`` entry-point group); see
``docs/adding-a-quantization-method.md``.
"""

from llmpress.loading import compressed_tensors, fp8_source, on_load, transformers_quantizer  # noqa: F401  (the built-in methods, and their registration with transformers)
from llmpress.loading.config import CompressedTensorsConfig, LlmpressConfig, QuantizationConfig, QuantizationMethod
from llmpress.loading.loader import load, load_checkpoint, read_checkpoint, read_model_and_processor
from llmpress.loading.methods import METHODS, Method, config_from_dict, register_quantization_method
from llmpress.loading.quantizer import Quantizer

__all__ = [
    "METHODS",
    "CompressedTensorsConfig",
    "LlmpressConfig",
    "Method",
    "QuantizationConfig",
    "QuantizationMethod",
    "Quantizer",
    "config_from_dict",
    "load",
    "load_checkpoint",
    "read_checkpoint",
    "read_model_and_processor",
    "register_quantization_method",
]
