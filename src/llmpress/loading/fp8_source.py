"""Hugging Face ``quant_method: fp8`` checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-FP8, ...) as sources
(the layout: ``formats/hf_fp8.py``). Each fp8 weight and its ``weight_scale_inv`` are dequantized
as they stream in (in float32, then the model's dtype), so any recipe can compress the model
again and no fp8 tensor is kept. llmpress has no runtime for this format: it always
loads dense. Static activation scales (``activation_scale``) are dropped: a recipe calibrates its
own. ``ue8m0`` scales and DeepSeek-V4's fp4 experts are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.errors import CheckpointError
from llmpress.formats.hf_fp8 import DROPPED_NAMES, SCALE_NAME, check_fp8_source, dequantize_fp8, fp8_source_args
from llmpress.loading.config import QuantizationConfig
from llmpress.loading.methods import register_quantization_method
from llmpress.loading.quantizer import Quantizer

__all__ = ["FP8SourceConfig", "FP8SourceQuantizer"]


class FP8SourceConfig(QuantizationConfig):
    """transformers' ``FineGrainedFP8Config`` entry of a checkpoint, read as a source."""

    quant_method = "fp8"

    def __init__(self, weight_block_size: list[int] | None = (128, 128), activation_scheme: str = "dynamic",
                 modules_to_not_convert: list[str] | None = None, scale_fmt: str = "float", expert_dtype: str = "fp8",
                 dequantize: bool = True, **other: Any) -> None:
        self.weight_block_size = check_fp8_source(
            {"scale_fmt": scale_fmt, "expert_dtype": expert_dtype, "weight_block_size": weight_block_size})
        self.activation_scheme = activation_scheme
        self.modules_to_not_convert = modules_to_not_convert
        self.scale_fmt, self.expert_dtype = scale_fmt, expert_dtype
        self.dequantize = True  # the only way llmpress reads it
        self._other = other


@register_quantization_method("fp8", config=FP8SourceConfig)
class FP8SourceQuantizer(Quantizer):
    requires_calibration = True  # it reads fp8 checkpoints; it does not make them
    config: FP8SourceConfig

    def _process_model_before_weight_loading(self, model: nn.Module) -> None:
        self.args = fp8_source_args(self.config.weight_block_size)
        self.owners = frozenset(key.rpartition(".")[0] for key in self.checkpoint_keys if key.endswith(f".{SCALE_NAME}"))
        self.waiting: dict[str, dict[str, torch.Tensor]] = {owner: {} for owner in self.owners}  # until both arrive
        self.quantized_modules = sorted(self.owners)

    def param_needs_quantization(self, model: nn.Module, param_name: str) -> bool:
        owner, _, local = param_name.rpartition(".")
        return owner in self.owners and local in ("weight", SCALE_NAME, *DROPPED_NAMES)

    def create_quantized_param(self, model: nn.Module, param_name: str, tensor: torch.Tensor, device: torch.device) -> None:
        owner, _, local = param_name.rpartition(".")
        if local in DROPPED_NAMES:
            return
        parts = self.waiting[owner]
        parts[local] = tensor
        if len(parts) < 2:
            return
        module = model.get_submodule(owner)
        current = module.weight
        weight = dequantize_fp8(parts.pop("weight"), parts.pop(SCALE_NAME), self.args, current.dtype)
        if tuple(weight.shape) != tuple(current.shape):
            raise CheckpointError(f"tensor {owner}.weight has the wrong shape for the model", got=tuple(weight.shape),
                                  expected=tuple(current.shape), fix="check that config.json and the weights belong together")
        module.weight = nn.Parameter(weight.to(device), requires_grad=current.requires_grad)
        del self.waiting[owner]

    def update_missing_keys(self, model: nn.Module, missing: list[str]) -> list[str]:
        if self.waiting:
            owner, parts = next(iter(self.waiting.items()))
            raise CheckpointError(
                f"{len(self.waiting)} fp8 weight(s) of the checkpoint lack their weight or scale",
                got=f"{owner}: {sorted(parts) or 'nothing'}", expected=f"weight and {SCALE_NAME}",
            )
        return missing
