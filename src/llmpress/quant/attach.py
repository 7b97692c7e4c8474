"""Quantization state on a module: the scheme, its scales, and the input fake-quant hook.

A quantized ``nn.Linear`` carries ``quantization_scheme`` and buffers ``weight_scale``
(``weight_zero_point`` when asymmetric) and, for static activations, ``input_scale``. Its weight
holds values on the quantization grid once frozen, so a plain forward already computes what the
compressed model computes; input activations are fake-quantized by a forward pre-hook.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.quant.observers import weight_qparams
from llmpress.quant.qdq import fake_quantize, fake_quantize_activation
from llmpress.quant.scheme import QuantizationScheme

__all__ = [
    "attach_scheme",
    "quantized_modules",
    "freeze_weight",
    "set_weight_qparams",
    "set_module_buffer",
    "set_input_scale",
    "enable_input_quantization",
    "detach_quantization",
]

_HOOK = "_llmpress_input_quant_hook"


def attach_scheme(module: nn.Module, scheme: QuantizationScheme) -> None:
    module.quantization_scheme = scheme


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module, QuantizationScheme]]:
    return [
        (name, m, m.quantization_scheme)
        for name, m in model.named_modules()
        if getattr(m, "quantization_scheme", None) is not None
    ]


def set_module_buffer(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set, replace or (with None) remove a persistent buffer such as ``weight_scale``."""
    if value is None:
        if name in module._buffers:
            del module._buffers[name]
        return
    if name in module._buffers:
        module._buffers[name] = value
    else:
        module.register_buffer(name, value)


def freeze_weight(module: nn.Module, scale_dtype: torch.dtype | None = None) -> float:
    """Round the weight onto its quantization grid, store scale / zero point; return the
    relative L2 error of the rounding (a per-module quality figure for reports)."""
    args = module.quantization_scheme.weights
    weight = module.weight.data
    scale, zero_point = weight_qparams(weight, args)
    scale = scale.to(scale_dtype or weight.dtype)
    quantized = fake_quantize(weight.float(), scale, zero_point, args)
    error = float((quantized - weight.float()).norm() / weight.float().norm().clamp(min=1e-12))
    weight.copy_(quantized)  # in place: no second copy of the weight (and mmap pages stay shared)
    set_module_buffer(module, "weight_scale", scale)
    set_module_buffer(module, "weight_zero_point", zero_point)
    return error


def set_weight_qparams(
    module: nn.Module, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
) -> None:
    """Store a weight already on its grid (from GPTQ, say) with the qparams that define the grid."""
    dtype = module.weight.dtype
    module.weight.data.copy_(weight)  # in place, as in freeze_weight
    set_module_buffer(module, "weight_scale", scale.to(dtype))
    set_module_buffer(module, "weight_zero_point", zero_point)


def set_input_scale(module: nn.Module, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
    """A static input scale (and zero point, for asymmetric inputs), as compressed-tensors stores them."""
    set_module_buffer(module, "input_scale", scale.reshape(1).to(module.weight.dtype))
    set_module_buffer(module, "input_zero_point", None if zero_point is None else zero_point.reshape(1))


def enable_input_quantization(module: nn.Module) -> None:
    """Fake-quantize the module's input on every forward, as the compressed model does."""
    args = module.quantization_scheme.input_activations
    if args is None or getattr(module, _HOOK, None) is not None:
        return

    def hook(mod: nn.Module, inputs: tuple) -> tuple:
        scale, zero_point = getattr(mod, "input_scale", None), getattr(mod, "input_zero_point", None)
        return (fake_quantize_activation(inputs[0], args, scale, zero_point), *inputs[1:])

    setattr(module, _HOOK, module.register_forward_pre_hook(hook))


def detach_quantization(module: nn.Module) -> None:
    """Remove every trace of quantization state from a module (its weight is left as it is)."""
    handle = getattr(module, _HOOK, None)
    if handle is not None:
        handle.remove()
        setattr(module, _HOOK, None)
    for name in ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point"):
        set_module_buffer(module, name, None)
    module.quantization_scheme = None
