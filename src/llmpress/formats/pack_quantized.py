"""``pack-quantized``: integer weights of 1..8 bits packed densely into int32 ``weight_packed``.

Stored per module: ``weight_packed`` int32 ``[out, ceil(in * bits / 32)]``, ``weight_scale``,
``weight_shape`` int64 ``[2]`` and, for asymmetric group/channel quantization, ``weight_zero_point``
packed the same way along the output dimension.
"""

from __future__ import annotations

import torch

from llmpress.formats.base import FORMATS, StateDict, dequantize_unpacked, drop_symmetric_zero_points
from llmpress.quant.packing import pack_to_int32, unpack_from_int32
from llmpress.quant.qdq import quantize
from llmpress.quant.scheme import QuantizationScheme, QuantizationStrategy

PACKED_ZERO_POINT_STRATEGIES = (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL)


@FORMATS.register("pack-quantized")
class PackQuantizedFormat:
    name = "pack-quantized"

    @staticmethod
    def compress(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        out = drop_symmetric_zero_points(state, scheme)
        out["weight"] = quantize(out["weight"], out["weight_scale"], out.get("weight_zero_point"), scheme.weights)
        return PackQuantizedFormat.pack(out, scheme)

    @staticmethod
    def pack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        args = scheme.weights
        out = drop_symmetric_zero_points(state, scheme)
        q = out.pop("weight")
        zero_point = out.get("weight_zero_point")
        out["weight_packed"] = pack_to_int32(q, args.num_bits)
        out["weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        if zero_point is not None and args.strategy in PACKED_ZERO_POINT_STRATEGIES:
            out["weight_zero_point"] = pack_to_int32(zero_point.to(torch.int8), args.num_bits, dim=0)
        return out

    @staticmethod
    def unpack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        args = scheme.weights
        out = dict(state)
        packed = out.pop("weight_packed")
        shape = tuple(int(v) for v in out.pop("weight_shape").tolist())
        zero_point = out.get("weight_zero_point")
        if zero_point is not None and args.strategy in PACKED_ZERO_POINT_STRATEGIES:
            zp_shape = (shape[0], out["weight_scale"].shape[-1])
            out["weight_zero_point"] = unpack_from_int32(zero_point, args.num_bits, zp_shape, dim=0)
        out["weight"] = unpack_from_int32(packed, args.num_bits, shape)
        return out

    @staticmethod
    def decompress(state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
        return dequantize_unpacked(PackQuantizedFormat.unpack(state, scheme), scheme, dtype)
