"""Dense ``nn.Linear`` (or ``Conv1D``) on the quantization grid: the exact, uncompressed view of a quantized
module (scheme attached, scales as buffers, inputs fake-quantized), as compressed-tensors
computes it in full precision. Used by ``load(..., dequantize=True)`` and ``Quantizer.dequantize``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.formats import FORMATS
from llmpress.lifecycle.attach import attach_scheme, enable_input_quantization, set_module_buffer
from llmpress.lifecycle.state import Status, state_of
from llmpress.models.classes import model_dtype
from llmpress.models.linear import Conv1D
from llmpress.quant.scheme import QuantizationScheme
from llmpress.runtime import QuantizedLinear

__all__ = ["dense_linear", "dequantize_model"]


def dense_linear(
    in_features: int, out_features: int, state: dict[str, torch.Tensor], scheme: QuantizationScheme,
    fmt: str, dtype: torch.dtype, input_major: bool = False, into: nn.Module | None = None,
) -> nn.Module:
    """An ``nn.Linear`` from one module's stored tensors in format ``fmt``; ``input_major``:
    a ``Conv1D``, its weight stored ``[in, out]``; ``into``: a module to fill instead (an MoE
    router that is a Linear subclass computing the routing, kept for its forward)."""
    local = FORMATS.get(fmt).decompress(state, scheme, dtype)
    if into is not None:
        linear = into
    elif input_major:  # Conv1D always adds a bias
        with torch.device("meta"):
            linear = Conv1D(out_features, in_features)
        local.setdefault("bias", torch.zeros(out_features))
    else:
        linear = nn.Linear(in_features, out_features, bias="bias" in local, device="meta")
    linear.weight = nn.Parameter(local.pop("weight").to(dtype), requires_grad=False)
    if "bias" in local:
        linear.bias = nn.Parameter(local.pop("bias").to(dtype), requires_grad=False)
    attach_scheme(linear, scheme)
    for name, value in local.items():
        set_module_buffer(linear, name, value)
    state_of(linear).status = Status.FROZEN  # on its grid, its qparams read from the checkpoint
    enable_input_quantization(linear)
    return linear


def dequantize_model(model: nn.Module) -> nn.Module:
    """Swap every ``QuantizedLinear`` of ``model`` for its dense module, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            dtype = module.bias.dtype if module.bias is not None else model_dtype(model)
            dense = dense_linear(
                module.in_features, module.out_features, module.compressed_state(),
                module.scheme, module.format, dtype, module.input_major,
            )
            model.set_submodule(name, dense)
    return model
