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

Each mapping's input channels get
``s = range(X)^a / (2 max|W|)^(1 - a)`` (``range`` = max - min of the channel over the
calibration tokens, ``max|W|`` over the balance layers' column, as llm-compressor computes it), or
``range / log2(2 + range)`` for ``algorithm: log_equalization``. ``1/s`` goes into the norm,
``s`` into the Linears: the model computes the same function, with flatter activations. The
quantizers of the stage then calibrate the block as it now is (GPTQ's Hessians are of the
smoothed inputs). Without ``mappings`` they are read from each block (``mappings.py``): norms to
the Linears reading their output.

Where the ranges come from:

- where the block is calibrated in one observing run (two passes) and every other modifier
  watching a mapping's balance layers comes later in the recipe and can rescale what it
  gathered (GPTQ's Hessians: ``diag(1/s) H diag(1/s)``), the ranges are read in that very run
  and the scales folded in at ``modules_calibrated``, before the others use what they gathered:
  the block runs twice, not three times. They are read at a balance layer the run observes that
  sees every token: not an MoE expert, unless every expert calibrates on every token
  (``calibrating_all_experts``, the default), as for Qwen3-MoE's norm, whose other reader, the
  router, nobody observes;
- otherwise the block runs on its calibration inputs once at ``block_start``, before anything of
  it is observed or quantized, up to the last mapping's input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import field_validator
from torch import nn

from llmpress.contract.modifier import MODIFIERS, Modifier, State
from llmpress.errors import SessionError
from llmpress.lifecycle.state import scheme_of
from llmpress.models.linear import input_major
from llmpress.modifiers.smoothing.base import SmoothingConfig, SmoothingModifier
from llmpress.modifiers.smoothing.fold import apply_scales
from llmpress.modifiers.smoothing.mappings import Mapping
from llmpress.modifiers.smoothing.statistics import ChannelStatistics, channel_statistics

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["LogarithmicEqualizationModifier", "SmoothQuantModifier", "SmoothQuantModifierConfig"]

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

    def on_initialize(self, state: State) -> None:
        super().on_initialize(state)
        self.deferred: list[tuple[Mapping, ChannelStatistics]] = []  # mappings whose ranges this block's observing run reads

    def smooth(self, block: CalibrationBlock, mappings: list[Mapping]) -> None:
        watched = {id(m): self._watched_balance(block, m) for m in mappings}
        now = [m for m in mappings if watched[id(m)] is None]
        if now:
            stats = channel_statistics(block, now, self.config.num_calibration_steps, abs_mean=False)
            for mapping in now:
                self._fold(mapping, stats[mapping.smooth_name])
        for mapping in mappings:
            if watched[id(mapping)] is not None:
                self.deferred.append((mapping, ChannelStatistics(f"{type(self).__name__}, {mapping.smooth_name}", abs_mean=False)))
                block.observation.watch(watched[id(mapping)], self, mapping.smooth_name)

    def _watched_balance(self, block: CalibrationBlock, mapping: Mapping) -> nn.Module | None:
        """The balance layer whose inputs give the mapping's ranges in the block's observing run,
        or None where the ranges must come first, from a run of their own: the block is not
        observed at once, or another modifier watching a balance layer comes before this one or
        cannot rescale what it gathers."""
        observation = block.observation
        if not block.observed_at_once or observation is None:
            return None
        order = {id(m): i for i, m in enumerate(observation.modifiers)}
        mine = order.get(id(self), -1)
        seen_by = [(m, w) for m in mapping.balance for w in observation.watchers.get(m, ())]
        if not seen_by or any(order.get(id(w), -1) <= mine or not w.scales_inputs(n) for _, (w, n) in seen_by):
            return None
        # one that sees every token and that the run observes (a target)
        seeing = [m for m in mapping.balance_seeing_every_token(block.module) if observation.watchers.get(m)]
        return seeing[0] if seeing else None

    def observe(self, name: str, x: torch.Tensor) -> None:
        stats = next(stats for mapping, stats in self.deferred if mapping.smooth_name == name)
        steps = self.config.num_calibration_steps
        if steps is None or stats.batches < steps:
            stats.add(x)

    def on_modules_calibrated(self, state: State, block: CalibrationBlock, modules: list[nn.Module]) -> None:
        """The observing run is over: fold the scales in, then have the later watchers rescale
        what they gathered from the balance layers' (now smoothed) inputs."""
        if not self.deferred:
            return
        block.observation.unwatch(self)
        for mapping, stats in self.deferred:
            scales = self._fold(mapping, stats.reduced())
            names: dict[int, tuple[Modifier, list[str]]] = {}
            for module in mapping.balance:
                for watcher, name in block.observation.watchers.get(module, ()):
                    names.setdefault(id(watcher), (watcher, []))[1].append(name)
            for watcher, watched in names.values():
                watcher.scale_inputs(watched, 1.0 / scales.to(torch.float64))
        self.deferred = []

    def on_layer_calibrated(self, state: State, block: CalibrationBlock) -> None:
        if self.deferred:  # the pipeline's promise (observed_at_once) was not kept
            raise SessionError(f"{type(self).__name__}: block {block.index} ended before its observing run was reported",
                               expected="modules_calibrated after the run that observes the whole block")

    def _fold(self, mapping: Mapping, seen: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mapping's scales from its inputs' ranges, folded into it; returns them."""
        scales = self._scales(mapping, seen["max"] - seen["min"])
        apply_scales(mapping, scales)
        return scales

    def _scales(self, mapping: Mapping, activation_range: torch.Tensor) -> torch.Tensor:
        if self.config.algorithm == "log_equalization":
            scales = activation_range / torch.log2(2 + activation_range)
        else:
            alpha = self.config.smoothing_strength
            # the layers a quantizer will round (an ignored router takes the scales exactly)
            rounded = [m for m in mapping.balance if scheme_of(m) is not None] or mapping.balance
            weight_range = 2.0 * torch.stack([m.weight.detach().abs().float().amax(dim=1 if input_major(m) else 0)
                                              for m in rounded]).amax(dim=0)
            scales = activation_range.pow(alpha) / weight_range.pow(1 - alpha)
            scales = torch.where(weight_range > 0, scales, activation_range)
        return scales.clamp(min=MINIMUM_SCALE)


class LogarithmicEqualizationModifierConfig(SmoothQuantModifierConfig):
    algorithm: Literal["smoothquant", "log_equalization"] = "log_equalization"


@MODIFIERS.register("LogarithmicEqualizationModifier")
class LogarithmicEqualizationModifier(SmoothQuantModifier):
    """llm-compressor's older name of ``SmoothQuantModifier(algorithm="log_equalization")``
    (deprecated there, still read), so that its recipes run unchanged."""

    Config = LogarithmicEqualizationModifierConfig
