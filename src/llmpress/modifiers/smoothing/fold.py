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

from llmpress.models.linear import input_major

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
    saved = [(t, t.detach().clone()) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]
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
    except Exception:  # noqa: BLE001 -- any failure of the probe: not such a norm, and the check by running decides
        offset = 0.0
    finally:
        for tensor, value in saved:
            tensor.copy_(value)
    _OFFSETS[module] = offset
    return offset


@torch.no_grad()
def apply_scales(mapping: Mapping, scales: torch.Tensor) -> None:
    """Fold ``scales`` into the mapping: the smooth layer's output channels divided by them (only
    ``mapping.rows`` of a fused Linear), the balance layers' input columns multiplied (the
    function is unchanged). Computed in float64 for float64 scales (AWQ's, as llm-compressor
    folds them), else in float32.

    A norm's gain ``c + weight`` is divided as a whole (``gain_offset``): the weight becomes
    ``(c + weight) / s - c``, near ``-c`` for large ``s``, where bf16 keeps only a few bits of
    the gain (10% off at ``s = 50``). So its gain is kept at least a few steps of the weight's
    dtype from zero, and the balance layers take the scale the stored gain gives,
    ``(c + weight) / (c + stored)``, which keeps the function in any dtype."""
    smooth = mapping.smooth
    compute = torch.float64 if scales.dtype == torch.float64 else torch.float32
    s = scales.to(compute)
    column = s.view(-1, 1) if isinstance(smooth, nn.Linear) else s
    rows = slice(*mapping.rows) if mapping.rows is not None else slice(None)  # a fused Linear's part
    target = smooth.weight[rows]
    weight = target.to(compute)
    offset = 0.0 if isinstance(smooth, nn.Linear) or smooth.weight.dim() != 1 else gain_offset(smooth)
    if offset:
        s = _offset_fold(target, weight, offset, s.to(weight.device))
    else:
        target.copy_((weight / column.to(weight.device)).to(smooth.weight.dtype))
    bias = getattr(smooth, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias[rows].copy_((bias[rows].to(compute) / s.to(bias.device)).to(bias.dtype))
    for linear in mapping.balance:  # input channels: a Linear's columns, a Conv1D's rows
        per_input = s.view(-1, 1) if input_major(linear) else s
        linear.weight.copy_((linear.weight.to(compute) * per_input.to(linear.weight.device)).to(linear.weight.dtype))


def _offset_fold(target: torch.Tensor, weight: torch.Tensor, offset: float, s: torch.Tensor) -> torch.Tensor:
    """Store ``(offset + weight) / s - offset`` into ``target`` (the gain kept at least 4 steps of
    the dtype from zero, its sign kept) and return the scales the stored gain gives."""
    gain = weight + offset
    floor = 4 * torch.finfo(target.dtype).eps * abs(offset)
    wanted = gain / s
    wanted = torch.where(wanted.abs() < floor, floor * torch.sign(gain), wanted)
    target.copy_((wanted - offset).to(target.dtype))
    stored = target.to(weight.dtype) + offset
    return torch.where(stored != 0, gain / stored, s)
