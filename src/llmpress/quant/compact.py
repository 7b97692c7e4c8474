"""Finished layers' weights held as integers while layer-by-layer calibration goes on.

Once a layer is compressed and has produced the next layer's inputs, its weights are not read
again until calibration ends. A weight on its quantization grid is ``k * scale`` with small
integers ``k``, so it can wait as ``k`` (int8: a quarter of fp32) and be rebuilt bit for bit at
the end: ``k * scale`` is the same float product that put it on the grid. The full-precision
weights of a whole model then never sit in memory together with the calibration state
(activations, Hessians, solver temporaries): the peak is one layer in float plus the rest in
int8. Each weight is rebuilt and compared before its float copy is dropped; a weight that does
not come back exactly (not on its grid yet, an unusual scheme) stays as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.quant.qdq import expand_to_columns

__all__ = ["CompactWeights"]


def _grid_values(module: nn.Module) -> torch.Tensor | None:
    """``k`` with ``weight == k * scale`` (scale expanded to columns) exactly, or None."""
    scheme = getattr(module, "quantization_scheme", None)
    scale = getattr(module, "weight_scale", None)
    weight = getattr(module, "weight", None)
    args = None if scheme is None else scheme.weights
    if args is None or scale is None or not isinstance(weight, nn.Parameter) or weight.device.type != "cpu":
        return None
    if weight.dim() != 2 or args.num_bits > 8:
        return None
    w = weight.detach()
    try:
        expanded = expand_to_columns(scale.to(torch.float32), w.shape[1], args)
        ratio = w.float() / expanded
        if args.is_float:
            k = ratio.to(torch.float8_e4m3fn)
        else:
            wide = args.num_bits == 8 and getattr(module, "weight_zero_point", None) is not None
            k = ratio.round_().to(torch.int16 if wide else torch.int8)
        del ratio
        rebuilt = (k.float() * expanded).to(w.dtype)
    except (RuntimeError, ValueError):  # shapes a scheme expands differently: leave it alone
        return None
    return k if torch.equal(rebuilt, w) else None


def _refuse_while_held(module: nn.Module, inputs: tuple) -> None:
    raise RuntimeError(
        f"{type(module).__name__} is held as integers until layer-by-layer calibration ends; "
        "it cannot run before CompactWeights.restore()"
    )


class CompactWeights:
    """``hold(layer)`` swaps its on-grid weights for integers; ``restore()`` puts every one back
    (same Parameter objects, same values). While held, the module's ``weight`` is a ``meta``
    tensor of the right shape and running the module raises, so an accidental use fails
    loudly instead of computing with nothing."""

    def __init__(self) -> None:
        self._held: list[tuple[nn.Module, nn.Parameter, torch.Tensor, torch.Tensor, torch.dtype, object, object]] = []

    @property
    def held_bytes(self) -> int:
        return sum(entry[2].numel() * entry[2].element_size() for entry in self._held)

    def hold(self, layer: nn.Module) -> int:
        """Hold what can be held in ``layer``; returns the bytes of float weight let go."""
        freed = 0
        for module in layer.modules():
            k = _grid_values(module)
            if k is None:
                continue
            param: nn.Parameter = module.weight
            args = module.quantization_scheme.weights
            scale = module.weight_scale.to(torch.float32)
            freed += param.numel() * param.element_size()
            guard = module.register_forward_pre_hook(_refuse_while_held)
            self._held.append((module, param, k, scale, param.dtype, args, guard))
            placeholder = torch.empty(param.shape, dtype=param.dtype, device="meta")
            module._parameters["weight"] = nn.Parameter(placeholder, requires_grad=param.requires_grad)
            param.data = torch.empty(0, dtype=param.dtype)  # the float storage goes back now
        return freed

    def restore(self) -> None:
        while self._held:
            module, param, k, scale, dtype, args, guard = self._held.pop()
            guard.remove()
            expanded = expand_to_columns(scale, k.shape[1], args)
            param.data = (k.float() * expanded).to(dtype)
            module._parameters["weight"] = param
