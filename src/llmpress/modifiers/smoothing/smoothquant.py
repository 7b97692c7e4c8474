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

import logging
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import field_validator
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.modifiers.base import MODIFIERS, Modifier, ModifierConfig, OneShotFields, State
from llmpress.modifiers.smoothing.mappings import Mapping, apply_scales, find_mappings, resolve_mappings

if TYPE_CHECKING:
    from llmpress.pipelines.blocks import CalibrationBlock

__all__ = ["SmoothQuantModifier", "SmoothQuantModifierConfig"]

logger = logging.getLogger(__name__)

MINIMUM_SCALE = 1e-5


class SmoothQuantModifierConfig(ModifierConfig, OneShotFields):
    smoothing_strength: float = 0.5
    mappings: list[tuple[list[str], str]] | None = None
    ignore: list[str] = []
    num_calibration_steps: int | None = None  # batches whose activations set the ranges (default: all)
    algorithm: Literal["smoothquant", "log_equalization"] = "smoothquant"

    @field_validator("smoothing_strength")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"smoothing_strength must be within [0, 1], got {value}")
        return value

    @field_validator("ignore", mode="before")
    @classmethod
    def _none_is_empty(cls, value):
        return [] if value is None else value


@MODIFIERS.register("SmoothQuantModifier")
class SmoothQuantModifier(Modifier):
    Config = SmoothQuantModifierConfig

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data")

    def on_initialize(self, state: State) -> None:
        self.prefix_of = {m: f"{n}." for n, m in state.model.named_modules()}
        self.smoothed: list[str] = []  # one line per mapping applied
        self.blocks = 0
        self._last_found = ""

    def on_block_start(self, state: State, block: CalibrationBlock) -> None:
        self.blocks += 1
        prefix = self.prefix_of.get(block.module, "")
        if self.config.mappings:
            mappings, skipped = resolve_mappings(block, prefix, self.config.mappings, self.config.ignore)
        else:
            mappings, skipped = find_mappings(block, prefix, self.config.ignore)
        found = "; ".join(m.describe() for m in mappings)
        if found != self._last_found or skipped:
            logger.info("%s, block %d: %s%s", type(self).__name__, block.index, found or "no mapping",
                        f" (skipped: {'; '.join(skipped)})" if skipped else "")
            self._last_found = found
        if not mappings:
            return
        ranges = self._activation_ranges(block, mappings)
        for mapping in mappings:
            apply_scales(mapping, self._scales(mapping, ranges[mapping.smooth_name]))
            self.smoothed.append(f"{mapping.smooth_name} -> {', '.join(mapping.balance_names)}")

    @torch.no_grad()
    def _activation_ranges(self, block: CalibrationBlock, mappings: list[Mapping]) -> dict[str, torch.Tensor]:
        """max - min of each mapping's input channels over the block's calibration tokens."""
        low: dict[str, torch.Tensor] = {}
        high: dict[str, torch.Tensor] = {}
        handles = []
        for mapping in mappings:
            def seen(module: nn.Module, args: tuple, name: str = mapping.smooth_name) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                low[name] = torch.minimum(low[name], x.amin(0)) if name in low else x.amin(0)
                high[name] = torch.maximum(high[name], x.amax(0)) if name in high else x.amax(0)

            handles.append(mapping.balance[0].register_forward_pre_hook(seen))
        try:
            block.run(block.module, block.inputs[: self.config.num_calibration_steps])
        finally:
            for handle in handles:
                handle.remove()
        return {name: high[name] - low[name] for name in high}

    def _scales(self, mapping: Mapping, activation_range: torch.Tensor) -> torch.Tensor:
        if self.config.algorithm == "log_equalization":
            scales = activation_range / torch.log2(2 + activation_range)
        else:
            alpha = self.config.smoothing_strength
            weight_range = 2.0 * torch.stack([m.weight.detach().abs().float().amax(dim=0) for m in mapping.balance]).amax(dim=0)
            scales = activation_range.pow(alpha) / weight_range.pow(1 - alpha)
            scales = torch.where(weight_range > 0, scales, activation_range)
        return scales.clamp(min=MINIMUM_SCALE)

    def on_calibration_end(self, state: State) -> None:
        if self.blocks == 0:
            raise UnsupportedModelError(
                f"{type(self).__name__} smooths a model block by block and found no repeated blocks in it",
                got=type(state.model).__name__,
                expected="a model with a list of repeated layers (decoder or encoder blocks)",
            )
        if not self.smoothed:
            logger.warning("%s: no mapping found or kept in any block: nothing was smoothed", type(self).__name__)
        else:
            logger.info("%s: %d mappings smoothed (strength %.2f)", type(self).__name__, len(self.smoothed),
                        self.config.smoothing_strength)
