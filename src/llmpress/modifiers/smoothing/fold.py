"""Folding smoothing scales into a mapping: the smooth layer's output channels divided by ``s``,
the balance layers' input columns multiplied by it, so the function is unchanged.

A norm whose gain is ``c + weight`` (Gemma's RMSNorm: ``1 + weight``) takes ``1/s`` as
``(c + weight) / s - c``, its ``c`` read by running the norm (``gain_offset``): no table of norm
classes, where llm-compressor keeps one.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from llmpress.modifiers.smoothing.mappings import Mapping

__all__ = ["apply_scales", "gain_offset"]

#: each norm's ``gain_offset``, read once
_OFFSETS: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


@torch.no_grad()
def gain_offset(module: nn.Module) -> float:
    """The ``c`` of a norm whose per-channel gain is ``c + weight``: 0 for most norms
    (``x_hat * weight``), 1 for Gemma's RMSNorm (``x_hat * (1 + weight)``). Read by running the
    module on a random input with its weight set to 0 and then 1 (its bias, if any, to 0), and
    the parameters put back. A module that does not behave as such a norm gives 0: the check by
    running then decides whether its mapping keeps the function."""
    if module in _OFFSETS:
        return _OFFSETS[module]
    weight = module.weight
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    saved = [(t, t.detach().clone()) for t in (weight, bias) if t is not None]
    probe = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    offset = 0.0
    try:
        if bias is not None:
            bias.zero_()
        weight.zero_()
        zero = module.forward(probe)  # no hooks: what observes the block does not see the probe
        weight.fill_(1.0)
        one = module.forward(probe)
        if isinstance(zero, torch.Tensor) and isinstance(one, torch.Tensor) and zero.shape == one.shape == probe.shape:
            unit = one.float() - zero.float()  # x_hat
            clear = unit.abs() > 1e-3 * unit.abs().max()
            ratios = zero.float()[clear] / unit[clear]
            if ratios.numel() and (ratios - ratios.median()).abs().max() < 1e-2:
                median = ratios.median().item()
                offset = float(round(median)) if abs(median - round(median)) < 1e-2 else median
    except (RuntimeError, TypeError, ValueError):  # not callable on a plain tensor: not a norm
        offset = 0.0
    finally:
        for tensor, value in saved:
            tensor.copy_(value)
    _OFFSETS[module] = offset
    return offset


@torch.no_grad()
def apply_scales(mapping: Mapping, scales: torch.Tensor) -> None:
    """Fold ``scales`` into the mapping: the smooth layer's output channels divided by them, the
    balance layers' input columns multiplied (the function is unchanged). A norm's gain
    ``c + weight`` is divided as a whole (``gain_offset``). Computed in float64 for float64
    scales (AWQ's, as llm-compressor folds them), else in float32."""
    smooth = mapping.smooth
    compute = torch.float64 if scales.dtype == torch.float64 else torch.float32
    s = scales.to(compute)
    column = s.view(-1, 1) if isinstance(smooth, nn.Linear) else s
    rows = slice(*mapping.rows) if mapping.rows is not None else slice(None)  # a fused Linear's part
    target = smooth.weight[rows]
    weight = target.to(compute)
    offset = 0.0 if isinstance(smooth, nn.Linear) or smooth.weight.dim() != 1 else gain_offset(smooth)
    divided = (weight + offset) / column.to(weight.device) - offset if offset else weight / column.to(weight.device)
    target.copy_(divided.to(smooth.weight.dtype))
    bias = getattr(smooth, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias[rows].copy_((bias[rows].to(compute) / s.to(bias.device)).to(bias.dtype))
    for linear in mapping.balance:
        linear.weight.copy_((linear.weight.to(compute) * s.to(linear.weight.device)).to(linear.weight.dtype))
