"""``int-quantized`` and ``float-quantized``: one quantized value per byte, no packing.

``weight`` is stored as int8 (integer schemes) or float8_e4m3fn (fp8 schemes) beside its
``weight_scale`` (and ``weight_zero_point`` when asymmetric).
"""

from __future__ import annotations

import torch

from llmpress.formats.base import FORMATS, StateDict, dequantize_unpacked, drop_symmetric_zero_points
from llmpress.quant.qdq import quantize
from llmpress.quant.scheme import QuantizationScheme


class _OneValuePerByte:
    name = ""

    @staticmethod
    def compress(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        out = drop_symmetric_zero_points(state, scheme)
        out["weight"] = quantize(out["weight"], out["weight_scale"], out.get("weight_zero_point"), scheme.weights)
        return out

    @staticmethod
    def pack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        return drop_symmetric_zero_points(state, scheme)

    @staticmethod
    def unpack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        return dict(state)

    @staticmethod
    def decompress(state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
        return dequantize_unpacked(dict(state), scheme, dtype)


@FORMATS.register("int-quantized")
class IntQuantizedFormat(_OneValuePerByte):
    name = "int-quantized"


@FORMATS.register("float-quantized")
class FloatQuantizedFormat(_OneValuePerByte):
    name = "float-quantized"
