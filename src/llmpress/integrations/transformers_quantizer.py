"""llmpress's quantize-on-load inside ``transformers.AutoModelForCausalLM.from_pretrained``.

``from_pretrained(fp32_dir, quantization_config=LlmpressConfig(bits=4))`` goes through
transformers' quantizer hooks, which this adapter forwards to the same ``Quantizer`` class that
``llmpress.load`` uses. transformers routes a checkpoint tensor to a quantizer only when the model
skeleton has a parameter of that name, so each ``QuantizedLinear`` gets a ``meta`` placeholder
``weight`` until its real weight arrives and is quantized. Registration happens when the first
``LlmpressConfig`` is made (needs transformers 5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.errors import CheckpointError

__all__ = ["register"]

_REGISTERED = False


def register() -> None:
    """Register ``llmpress`` with transformers' quantizer and config registries (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from transformers.core_model_loading import ConversionOps
        from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    except ImportError:  # transformers 4.x: the quantizer API differs; llmpress.load still works
        return
    from llmpress.loading.config import QUANTIZERS, LlmpressConfig, QuantizationMethod

    method = QuantizationMethod.LLMPRESS.value

    class _QuantizeOnLoad(ConversionOps):
        def __init__(self, hf_quantizer: LlmpressHfQuantizer) -> None:
            self.hf_quantizer = hf_quantizer

        def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                    missing_keys: set[str] | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            inner = self.hf_quantizer.inner
            inner.create_quantized_param(model, full_layer_name, tensor, tensor.device)
            model.get_submodule(full_layer_name.rpartition(".")[0])._parameters.pop("weight", None)
            if missing_keys is not None:
                missing_keys.discard(full_layer_name)
            return {}  # the module holds its quantized weight; nothing left for transformers to set

    class LlmpressHfQuantizer(HfQuantizer):
        requires_calibration = False

        def __init__(self, quantization_config: LlmpressConfig, **kwargs: Any) -> None:
            super().__init__(quantization_config, **kwargs)
            self.inner = QUANTIZERS.get(method)(quantization_config, pre_quantized=self.pre_quantized)

        def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
            self.inner.validate_environment(device_map=device_map)

        def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
            return self.inner.update_dtype(dtype)

        def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
            self.inner.process_model_before_weight_loading(model, checkpoint_keys=set())
            for name in self.inner.quantized_modules:
                module = model.get_submodule(name)
                placeholder = torch.empty(module.out_features, module.in_features, dtype=self.inner.dtype, device="meta")
                module.register_parameter("weight", nn.Parameter(placeholder, requires_grad=False))

        def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
            return self.inner.param_needs_quantization(model, param_name)

        def get_quantize_ops(self) -> ConversionOps:
            return _QuantizeOnLoad(self)

        def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
            missing = self.inner.update_missing_keys(model, [])  # the quantized modules never filled
            if missing:
                raise CheckpointError("the checkpoint lacks weights of quantized modules", got=missing[:4])
            self.inner.process_model_after_weight_loading(model)  # saves now go through llmpress
            return model

        def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
            return self.inner.dequantize(model)

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return False

    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(method)(LlmpressConfig)
    if method not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(method)(LlmpressHfQuantizer)
    _REGISTERED = True

