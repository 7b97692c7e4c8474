"""``SmoothQuantModifier``: move activation outliers into the weights before int8 activation
quantization (Xiao et al., 2022).

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        SmoothQuantModifier:
          smoothing_strength: 0.8
          mappings:                                   # optional: found from the model when absent
            - [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]
            - [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]
        GPTQModifier:
          scheme: W8A8
          targets: [Linear]
          ignore: [lm_head]

At the start of each block (``block_start``, before anything of it is observed or quantized) the
block runs on its calibration inputs once; each mapping's input channels get
``s = range(X)^a / (2 max|W|)^(1 - a)`` (``range`` = max - min of the channel over the
calibration tokens, ``max|W|`` over the balance layers' column, as llm-compressor computes it), or
``range / log2(2 + range)`` for ``algorithm: log_equalization``. ``1/s`` goes into the norm,
``s`` into the Linears: the model computes the same function, with flatter activations. The
quantizers of the stage then calibrate the block as it now is (GPTQ's Hessians are of the
smoothed inputs). Without ``mappings`` they are read from each block (``mappings.py``): norms to
the Linears reading their output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import field_validator

from llmpress.modifiers.base import MODIFIERS
from llmpress.modifiers.smoothing.base import SmoothingConfig, SmoothingModifier
from llmpress.modifiers.smoothing.mappings import Mapping, apply_scales, channel_statistics

if TYPE_CHECKING:
    from llmpress.pipelines.blocks import CalibrationBlock

__all__ = ["SmoothQuantModifier", "SmoothQuantModifierConfig"]

MINIMUM_SCALE = 1e-5


class SmoothQuantModifierConfig(SmoothingConfig):
    smoothing_strength: float = 0.5
    num_calibration_steps: int | None = None  # batches whose activations set the ranges (default: all)
    algorithm: Literal["smoothquant", "log_equalization"] = "smoothquant"

    @field_validator("smoothing_strength")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"smoothing_strength must be within [0, 1], got {value}")
        return value


@MODIFIERS.register("SmoothQuantModifier")
class SmoothQuantModifier(SmoothingModifier):
    Config = SmoothQuantModifierConfig

    def smooth(self, block: CalibrationBlock, mappings: list[Mapping]) -> None:
        stats = channel_statistics(block, mappings, self.config.num_calibration_steps)
        for mapping in mappings:
            seen = stats[mapping.smooth_name]
            apply_scales(mapping, self._scales(mapping, seen["max"] - seen["min"]))

    def _scales(self, mapping: Mapping, activation_range: torch.Tensor) -> torch.Tensor:
        if self.config.algorithm == "log_equalization":
            scales = activation_range / torch.log2(2 + activation_range)
        else:
            alpha = self.config.smoothing_strength
            # the layers a quantizer will round (an ignored router takes the scales exactly)
            rounded = [m for m in mapping.balance if getattr(m, "quantization_scheme", None) is not None] or mapping.balance
            weight_range = 2.0 * torch.stack([m.weight.detach().abs().float().amax(dim=0) for m in rounded]).amax(dim=0)
            scales = activation_range.pow(alpha) / weight_range.pow(1 - alpha)
            scales = torch.where(weight_range > 0, scales, activation_range)
        return scales.clamp(min=MINIMUM_SCALE)
