"""``dense``: weights stay full precision (unquantized models, or sparse-only ones)."""

from __future__ import annotations

import torch

from llmpress.formats.base import FORMATS, StateDict
from llmpress.quant.qdq import quantize
from llmpress.quant.scheme import QuantizationScheme


@FORMATS.register("dense")
class DenseFormat:
    name = "dense"

    @staticmethod
    def compress(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        return dict(state)

    @staticmethod
    def unpack(state: StateDict, scheme: QuantizationScheme) -> StateDict:
        """A frozen (dense, on-grid) weight back to its integer values with the stored scale."""
        out = dict(state)
        out["weight"] = quantize(out["weight"], out["weight_scale"], out.get("weight_zero_point"), scheme.weights,
                                 out.get("weight_global_scale"))
        return out

    @staticmethod
    def decompress(state: StateDict, scheme: QuantizationScheme, dtype: torch.dtype) -> StateDict:
        out = dict(state)
        if "weight" in out and out["weight"].is_floating_point():
            out["weight"] = out["weight"].to(dtype)
        return out
