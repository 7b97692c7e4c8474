"""``int-quantized``, ``float-quantized`` and ``mxfp8-quantized``: one quantized value per byte,
no packing.

``weight`` is stored as int8 (integer schemes) or float8_e4m3fn (fp8 schemes) beside its
``weight_scale`` (and ``weight_zero_point`` when asymmetric); MXFP8's scales are powers of two
stored as uint8 exponents plus 127, one per group of 32 (``[out, in / 32]``), as compressed-tensors
writes them.
"""

from __future__ import annotations

import torch

from llmpress.formats.base import (
    FORMATS,
    StateDict,
    decode_mx_scale,
    dequantize_unpacked,
    drop_symmetric_zero_points,
    encode_mx_scale,
)
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


@FORMATS.register("mxfp8-quantized")
class MXFP8QuantizedFormat(_OneValuePerByte):
    name = "mxfp8-quantized"

    @staticmethod
    def compress(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        out = _OneValuePerByte.compress(state, scheme)
        out["weight_scale"] = encode_mx_scale(out["weight_scale"])
        return out

    @staticmethod
    def pack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        out = _OneValuePerByte.pack(state, scheme)
        out["weight_scale"] = encode_mx_scale(out["weight_scale"])
        return out

    @staticmethod
    def unpack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        out = dict(state)
        out["weight_scale"] = decode_mx_scale(out["weight_scale"])
        return out

    @classmethod
    def decompress(cls, state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
        return dequantize_unpacked(cls.unpack(state, scheme), scheme, dtype)
