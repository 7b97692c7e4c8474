"""Stateless on-disk codecs, one per compressed-tensors format.

``FORMATS.get(name).compress(module_state, scheme)`` and ``.decompress(...)``; ``format_for(scheme)``
picks the format a scheme is saved in: compressed-tensors' choice, except where vLLM reads only another.
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
        return "mxfp8-quantized" if weights.is_mx else "float-quantized"
    inputs = scheme.input_activations
    if inputs is None:  # integer weight-only: pack into int32
        return "pack-quantized"
    if weights.num_bits == 8 or (weights.num_bits == 4 and not inputs.is_float and inputs.num_bits == 8):
        return "int-quantized"  # one int8 a value: compressed-tensors' choice, what vLLM's W8A8 and W4A8 readers take
    # other widths, int4 or fp8 inputs: compressed-tensors would write int-quantized, which vLLM
    # reads for none of them; its readers of these (WNA8, WNA4, W4AFP8) take the packed layout
    return "pack-quantized"
