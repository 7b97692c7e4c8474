"""What every format codec is: a stateless pair ``compress`` / ``decompress``.

Both take one module's state dict (local names: ``weight``, ``weight_scale``, ``bias``...) and its
scheme, and return a new dict; the input is never mutated. ``compress`` expects ``weight`` to hold
values already on the quantization grid (or plain floats: they are rounded onto it here).
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmpress.quant.qdq import dequantize
from llmpress.quant.scheme import QuantizationScheme
from llmpress.registry import Registry

__all__ = ["FormatCodec", "FORMATS", "PackingCodec", "decode_mx_scale", "dequantize_unpacked", "drop_symmetric_zero_points",
           "encode_mx_scale"]

StateDict = dict[str, torch.Tensor]


class FormatCodec(Protocol):
    name: str

    def compress(self, state: StateDict, scheme: QuantizationScheme) -> StateDict: ...

    def decompress(
        self, state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype
    ) -> StateDict: ...

    def unpack(self, state: StateDict, scheme: QuantizationScheme) -> StateDict:
        """The stored state with ``weight`` as raw quantized values (int8 holding ``num_bits``
        integers, or float8) and zero points unpacked: what runtime kernels start from."""
        ...


class PackingCodec(FormatCodec, Protocol):
    """A codec that also takes raw quantized values: ``compress`` is ``pack`` of the weight
    quantized. A save packs the integers a finished layer is held as (``compact.py``) through it,
    without rebuilding the weight in float and rounding it back."""

    def pack(self, state: StateDict, scheme: QuantizationScheme) -> StateDict:
        """``unpack``'s inverse: ``weight`` as raw quantized values (``quantize``'s dtype and
        range) into the stored form."""
        ...


FORMATS: Registry[FormatCodec] = Registry("format")


def drop_symmetric_zero_points(state: StateDict, scheme: QuantizationScheme) -> StateDict:
    """Zero points of symmetric quantization are all zero: compressed-tensors does not store them."""
    out = dict(state)
    for prefix, args in (("weight", scheme.weights), ("input", scheme.input_activations)):
        if args is None or args.symmetric:
            out.pop(f"{prefix}_zero_point", None)
    return out


def dequantize_unpacked(state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
    """An ``unpack`` result with ``weight`` dequantized to ``dtype`` (in place): what every
    codec's ``decompress`` is after its own ``unpack``. Zero point and global scale when stored."""
    state["weight"] = dequantize(
        state["weight"], state["weight_scale"], state.get("weight_zero_point"), scheme.weights, dtype, state.get("weight_global_scale")
    )
    return state


def encode_mx_scale(scale: torch.Tensor) -> torch.Tensor:
    """An MX format's power-of-two scales as stored: uint8 exponents plus 127 (e8m0)."""
    return (torch.log2(scale.to(torch.float32)) + 127).round().clamp(0, 255).to(torch.uint8)


def decode_mx_scale(code: torch.Tensor) -> torch.Tensor:
    return torch.exp2(code.to(torch.float32) - 127)
