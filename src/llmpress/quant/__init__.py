"""Quantization math: schemes, observers, (fake-)quantize, int32 packing. Pure functions."""

from llmpress.quant.observers import weight_qparams
from llmpress.quant.packing import pack_to_int32, unpack_from_int32
from llmpress.quant.presets import PRESET_SCHEMES, preset_scheme
from llmpress.quant.qdq import (
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_activation,
    quantize,
)
from llmpress.quant.scheme import (
    QuantizationArgs,
    QuantizationScheme,
    QuantizationStrategy,
    QuantizationType,
)

__all__ = [
    "PRESET_SCHEMES",
    "QuantizationArgs",
    "QuantizationScheme",
    "QuantizationStrategy",
    "QuantizationType",
    "compute_qparams",
    "dequantize",
    "fake_quantize",
    "fake_quantize_activation",
    "pack_to_int32",
    "preset_scheme",
    "quantize",
    "unpack_from_int32",
    "weight_qparams",
]
