"""``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``: fp4 e2m1 weights two to a byte.

Stored per module, as compressed-tensors writes them:

- ``weight_packed`` uint8 ``[out, in / 2]``: element ``2j`` of a row in the low nibble, ``2j + 1``
  in the high one; a nibble is ``sign << 3 | i``, ``i`` the index of the magnitude in
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (a negative value rounded to zero keeps its sign bit);
- NVFP4: ``weight_scale`` float8_e4m3fn ``[out, in / 16]`` and ``weight_global_scale`` float32
  ``[1]`` (a value is ``q * weight_scale / weight_global_scale``), and for NVFP4 inputs
  ``input_global_scale``;
- MXFP4: ``weight_scale`` uint8 ``[out, in / 32]``, the exponent of a power-of-two scale plus 127.
"""

from __future__ import annotations

import torch

from llmpress import native
from llmpress.errors import CheckpointError
from llmpress.formats.base import (
    FORMATS,
    StateDict,
    decode_mx_scale,
    dequantize_unpacked,
    drop_symmetric_zero_points,
    encode_mx_scale,
)
from llmpress.quant.qdq import effective_scale, quantize
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["E2M1_VALUES", "pack_fp4", "quantize_and_pack", "unpack_fp4"]

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: twice a grid magnitude (0, 1, 2, 3, 4, 6, 8, 12) -> its index: one lookup, 6x faster than bucketize
_INDEX_OF_TWICE = torch.zeros(13, dtype=torch.uint8).index_put_(((E2M1_VALUES * 2).long(),), torch.arange(8, dtype=torch.uint8))


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """fp4 grid values ``[rows, cols]`` (cols even) two to a byte, uint8 ``[rows, cols / 2]``."""
    rows, cols = values.shape
    if cols % 2:
        raise CheckpointError("fp4 weights pack two values to a byte", got=f"{cols} columns",
                              expected="an even number of columns", fix="ignore this module, or pad its input features")
    if not torch.isfinite(values).all():
        _refuse_nonfinite(int((~torch.isfinite(values)).sum()))
    twice = values.abs().to(torch.float32).mul_(2).to(torch.int32).reshape(-1)
    index = _INDEX_OF_TWICE.to(values.device).index_select(0, twice).reshape(rows, cols)
    codes = (index | (torch.signbit(values).to(torch.uint8) << 3)).reshape(rows, cols // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4)


def _refuse_nonfinite(count: int) -> None:
    raise CheckpointError("fp4 weights to pack hold NaN or inf", got=f"{count} value(s)",
                          expected="finite weights", fix="check the model's weights (llmpress inspect --verify on its folder)")


def quantize_and_pack(weight: torch.Tensor, scale: torch.Tensor, args, global_scale: torch.Tensor | None) -> torch.Tensor:
    """``weight`` rounded onto the fp4 grid by its group scales and packed: in one pass by
    ``native.fp4_quantize_pack`` where it runs (the same bytes), else ``quantize`` then ``pack_fp4``."""
    fast = native.fp4_quantize_pack(weight, effective_scale(scale, args, global_scale), args.group_size) if args.group_size else None
    if fast is None:
        return pack_fp4(quantize(weight, scale, None, args, global_scale))
    packed, nans = fast
    if nans:
        _refuse_nonfinite(nans)
    return packed


_CODES = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # code -> value (code 8 is -0.0)
BYTE_VALUES = torch.stack([_CODES.repeat(16), _CODES.repeat_interleave(16)], dim=-1)  # byte -> (low, high) values


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pack_fp4``'s inverse: ``[rows, 2 * bytes]`` values in ``dtype``, one table lookup a
    byte (several times faster than splitting the nibbles first)."""
    table = BYTE_VALUES.to(device=packed.device, dtype=dtype)
    return table.index_select(0, packed.reshape(-1).int()).reshape(packed.shape[0], -1)


class _Fp4Packed:
    name = ""

    @staticmethod
    def compress(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        args = scheme.weights
        out = drop_symmetric_zero_points(state, scheme)
        weight = out.pop("weight")
        out["weight_packed"] = quantize_and_pack(weight, out["weight_scale"], args, out.get("weight_global_scale"))
        scale = out["weight_scale"]
        out["weight_scale"] = encode_mx_scale(scale) if args.is_mx else scale.to(torch.float8_e4m3fn)
        if "weight_global_scale" in out:
            out["weight_global_scale"] = out["weight_global_scale"].to(torch.float32).reshape(1)
        return out

    @staticmethod
    def unpack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        """``weight`` as float32 fp4 grid values and ``weight_scale`` as float32 scales."""
        out = dict(state)
        out["weight"] = unpack_fp4(out.pop("weight_packed"))
        scale = out["weight_scale"]
        out["weight_scale"] = decode_mx_scale(scale) if scheme.weights.is_mx else scale.to(torch.float32)
        return out

    @classmethod
    def decompress(cls, state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
        return dequantize_unpacked(cls.unpack(state, scheme), scheme, dtype)


@FORMATS.register("nvfp4-pack-quantized")
class NVFP4PackedFormat(_Fp4Packed):
    name = "nvfp4-pack-quantized"


@FORMATS.register("mxfp4-pack-quantized")
class MXFP4PackedFormat(_Fp4Packed):
    name = "mxfp4-pack-quantized"
