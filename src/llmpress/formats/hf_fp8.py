"""Hugging Face's ``quant_method: fp8`` layout (transformers' FineGrainedFP8; DeepSeek-V3,
Kimi-K2, Qwen3-FP8), read as a source: float8_e4m3fn weights, each with a float32
``weight_scale_inv`` per block of ``weight_block_size`` (or one per tensor without it); the dense
weight is their product, the grid compressed-tensors calls FP8_BLOCK. The loader
(``loading/fp8_source.py``) and the model-free path (``model_free``) both read it through here."""

from __future__ import annotations

from typing import Any

import torch

from llmpress.errors import CheckpointError
from llmpress.quant.qdq import dequantize
from llmpress.quant.scheme import QuantizationArgs

__all__ = ["DROPPED_NAMES", "SCALE_NAME", "check_fp8_source", "dequantize_fp8", "fp8_source_args"]

#: the name of each fp8 weight's scale in this format
SCALE_NAME = "weight_scale_inv"
#: static activation scales it may carry: dropped (a recipe calibrates its own)
DROPPED_NAMES = ("activation_scale", "input_scale")


def check_fp8_source(config: dict[str, Any]) -> list[int] | None:
    """The block size of a ``quant_method: fp8`` config (None: per tensor), or a clear error
    for the variants llmpress cannot read (``ue8m0`` scales, DeepSeek-V4's fp4 experts)."""
    scale_fmt, expert_dtype = config.get("scale_fmt", "float"), config.get("expert_dtype", "fp8")
    if scale_fmt != "float" or expert_dtype != "fp8":
        raise CheckpointError(
            "this fp8 checkpoint stores scales or experts in a form llmpress cannot read",
            got=f"scale_fmt={scale_fmt!r}, expert_dtype={expert_dtype!r}",
            expected="scale_fmt 'float' and expert_dtype 'fp8' (DeepSeek-V3, Qwen3-FP8 layouts)",
        )
    block = config.get("weight_block_size", (128, 128))
    return list(block) if block is not None else None


def fp8_source_args(block_size: list[int] | None) -> QuantizationArgs:
    """The format's grid as llmpress names it: fp8 in blocks, or per tensor."""
    if block_size is None:
        return QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    return QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(block_size))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, args: QuantizationArgs, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight, computed in float32 and rounded once to ``dtype``."""
    return dequantize(weight, scale_inv.float(), None, args, dtype)
