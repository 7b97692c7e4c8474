"""Stateless on-disk codecs, one per compressed-tensors format.

``FORMATS.get(name).compress(module_state, scheme)`` and ``.decompress(...)``; ``format_for(scheme)``
picks the format a scheme is saved in, as compressed-tensors would.
"""

from __future__ import annotations

from llmpress.formats import dense, fp4_packed, naive_quantized, pack_quantized  # noqa: F401  (registers)
from llmpress.formats.base import FORMATS, FormatCodec
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["FORMATS", "FormatCodec", "format_for"]


def format_for(scheme: QuantizationScheme) -> str:
    """The compressed-tensors format a scheme's weights are stored in."""
    if scheme.format:
        return scheme.format
    weights = scheme.weights
    if weights is None:
        return "dense"
    if weights.is_fp4:  # validated: NVFP4 (tensor_group of 16) or MXFP4 (groups of 32, uint8 scales)
        return "mxfp4-pack-quantized" if weights.is_mx else "nvfp4-pack-quantized"
    if weights.is_float:
        return "float-quantized"
    if scheme.input_activations is None:  # integer weight-only: pack into int32
        return "pack-quantized"
    return "int-quantized"
