"""llmpress's quantization methods inside ``transformers.AutoModelForCausalLM.from_pretrained``.

``LlmpressHfQuantizer`` is transformers' quantizer interface forwarded to the llmpress
``Quantizer`` registered for the config's ``quant_method`` (``llmpress.loading.methods``): one
generic adapter for every method, registered with transformers (its public
``register_quantizer``) for each method ``register_quantization_method`` registers. So ``from_pretrained(fp32_dir,
quantization_config=LlmpressConfig(bits=4))`` quantizes while loading with the same code as
``llmpress.load``. transformers routes a checkpoint tensor to a quantizer only when the model
skeleton has a parameter of that name, so a parameter the quantizer's modules no longer have
(a ``QuantizedLinear`` keeps packed integers, not ``weight``) gets a ``meta`` placeholder until
its tensor arrives. Needs transformers 5 (its ``ConversionOps`` loading); with transformers 4,
``llmpress.load`` still works and registration is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.compat import conversion_ops_base, mark_loaded, register_with_transformers
from llmpress.compat import unregister_from_transformers as compat_unregister
from llmpress.errors import CheckpointError
from llmpress.loading.methods import make_quantizer, when_registered

__all__ = ["LlmpressHfQuantizer", "unregister_from_transformers"]

try:
    from transformers.quantizers import HfQuantizer
except ImportError:  # transformers 4.x: another quantizer API
    HfQuantizer = None
ConversionOps = conversion_ops_base()


def _register(method: str, config: type) -> None:
    if HfQuantizer is not None and ConversionOps is not None:
        register_with_transformers(method, config, LlmpressHfQuantizer)


def unregister_from_transformers(method: str) -> None:
    """Undo the registration of ``method`` (a method registered by a test)."""
    if HfQuantizer is not None:
        compat_unregister(method, LlmpressHfQuantizer)


if HfQuantizer is not None and ConversionOps is not None:

    class LlmpressHfQuantizer(HfQuantizer):
        """transformers' quantizer hooks, forwarded to ``self.inner``: the llmpress quantizer
        of the config's method."""

        requires_calibration = False
        is_compileable = True  # llmpress's int4 operator is opaque to torch.compile, which calls it as it is

        def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
            super().__init__(quantization_config, **kwargs)
            self.inner = make_quantizer(quantization_config, pre_quantized=self.pre_quantized)

        def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
            self.inner.validate_environment(device_map=device_map)

        def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
            return self.inner.update_dtype(dtype) or dtype

        def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
            before = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
            self.inner.process_model_before_weight_loading(model, checkpoint_keys=set(before))
            now = dict(model.named_parameters())
            for name, (shape, dtype) in before.items():
                if name not in now and self.inner.param_needs_quantization(model, name):
                    owner, _, local = name.rpartition(".")
                    placeholder = torch.empty(shape, dtype=dtype, device="meta")
                    model.get_submodule(owner).register_parameter(local, nn.Parameter(placeholder, requires_grad=False))

        def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
            return self.inner.param_needs_quantization(model, param_name)

        def get_quantize_ops(self) -> ConversionOps:
            return _QuantizeWithLlmpress(self)

        def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
            missing = self.inner.update_missing_keys(model, [])  # what the quantized modules never got
            if missing:
                raise CheckpointError("the checkpoint lacks weights of quantized modules", got=missing[:4])
            self.inner.process_model_after_weight_loading(model)  # saves now go through llmpress
            return model

        def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
            return self.inner.dequantize(model)

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return self.inner.is_serializable

        @property
        def is_trainable(self) -> bool:
            return self.inner.is_trainable

    class _QuantizeWithLlmpress(ConversionOps):
        """Each claimed checkpoint tensor goes to the llmpress quantizer's
        ``create_quantized_param``; a placeholder it did not fill is removed, a tensor it put in
        place is marked as loaded (else transformers initialises it afterwards)."""

        def __init__(self, hf_quantizer: LlmpressHfQuantizer) -> None:
            self.hf_quantizer = hf_quantizer

        def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                    missing_keys: set[str] | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            self.hf_quantizer.inner.create_quantized_param(model, full_layer_name, tensor, tensor.device)
            owner, _, local = full_layer_name.rpartition(".")
            module = model.get_submodule(owner)
            left = getattr(module, local, None)
            if isinstance(left, nn.Parameter) and left.is_meta:
                delattr(module, local)  # the quantizer keeps the weight in its own form
            elif isinstance(left, torch.Tensor):
                mark_loaded(left)  # loaded: transformers must not initialise it
            if missing_keys is not None:
                missing_keys.discard(full_layer_name)
            return {}  # the module holds what it needs; nothing left for transformers to set

else:  # pragma: no cover - transformers 4
    LlmpressHfQuantizer = None

when_registered(_register)  # every method, those registered later included
