"""Quantization-aware training: a fake-quantized forward with a straight-through gradient.

While QAT is on, a quantized Linear computes ``linear(x, fq(W))`` where ``fq`` rounds the weight
onto its grid; the gradient passes the rounding unchanged (straight-through estimator), so the
optimizer keeps moving the full-precision weight. Input activations are fake-quantized the same
way by the module's input hook.

Scales: a module that already carries ``weight_scale`` (quantized by an earlier one-shot stage,
RTN or GPTQ) keeps that grid, so the first QAT step computes exactly what the one-shot model
computes and training only moves weights between grid points. A module without one gets its
scales from the current weight at every forward (the scheme's observer). ``finalize`` rounds the
weights onto the grid for good.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from llmpress.lifecycle.attach import set_weight_qparams
from llmpress.models.linear import input_major
from llmpress.parallel.fsdp import whole
from llmpress.quant.observers import weight_global_scale, weight_qparams
from llmpress.quant.qdq import fake_quantize

__all__ = ["PENDING_ATTR", "QAT_ATTR", "disable_qat", "enable_qat", "freeze_qat", "qat_snapshot", "qat_weight"]

# attribute on a module in QAT: True while its forward is fake-quantized
QAT_ATTR = "llmpress_qat"
# attribute on a module a live session will quantize later (QAT not started yet): a checkpoint
# saved meanwhile holds it rounded as finalize would round it now
PENDING_ATTR = "llmpress_quantize_pending"


def _qparams(module: nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The module's fixed grid when it has one, else the observer's qparams for ``weight``; and
    NVFP4's global scale (the module's, else ``weight``'s own), None for other schemes."""
    args = module.quantization_scheme.weights
    global_scale = getattr(module, "weight_global_scale", None)
    if args.has_global_scale and global_scale is None:
        global_scale = weight_global_scale([weight])
    scale = getattr(module, "weight_scale", None)
    if scale is not None:  # the grid of an earlier stage stays fixed
        return scale, getattr(module, "weight_zero_point", None), global_scale
    return (*weight_qparams(weight.detach(), args, global_scale), global_scale)


def qat_weight(module: nn.Module) -> torch.Tensor:
    """The weight the QAT forward uses: on its grid, with an identity gradient."""
    weight = module.weight
    args = module.quantization_scheme.weights
    if args is None:
        return weight
    scale, zero_point, global_scale = _qparams(module, weight)
    quantized = fake_quantize(weight, scale.to(weight.dtype), zero_point, args, global_scale)
    return weight + (quantized - weight).detach()


def _qat_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = qat_weight(self)
    return F.linear(x, weight.t() if input_major(self) else weight, self.bias)


def enable_qat(module: nn.Module) -> None:
    module.forward = types.MethodType(_qat_forward, module)
    setattr(module, QAT_ATTR, True)


def disable_qat(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)
    if hasattr(module, QAT_ATTR):
        delattr(module, QAT_ATTR)


@torch.no_grad()
def qat_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors as if QAT were frozen now, leaving the module untouched (what a
    checkpoint saved mid-training holds). A weight sharded by FSDP is taken whole (every rank
    calls), so its scales are those of the whole weight, the same on every rank."""
    weight = whole(module.weight.detach())
    args = module.quantization_scheme.weights
    local = {k: v.detach() for k, v in [*module._parameters.items(), *module._buffers.items()] if v is not None}
    local["weight"] = weight
    if args is None:  # activation-only scheme: the weight stays as it is
        return local
    scale, zero_point, global_scale = _qparams(module, weight)
    local["weight"] = fake_quantize(weight, scale.to(weight.dtype), zero_point, args, global_scale)
    local["weight_scale"] = scale.to(weight.dtype)
    if zero_point is not None:
        local["weight_zero_point"] = zero_point
    if global_scale is not None:
        local["weight_global_scale"] = global_scale
    return local


@torch.no_grad()
def freeze_qat(module: nn.Module) -> float:
    """End QAT: round the weight onto its grid for good and stop training it (an optimizer step
    after this would move it off the grid); return the relative rounding error."""
    disable_qat(module)
    if module.quantization_scheme.weights is None:
        return 0.0
    weight = whole(module.weight.detach())  # FSDP: the whole weight; set_weight_qparams writes back the shard
    snapshot = qat_snapshot(module)
    error = float((snapshot["weight"].float() - weight.float()).norm() / weight.float().norm().clamp(min=1e-12))
    set_weight_qparams(module, snapshot["weight"], snapshot["weight_scale"], snapshot.get("weight_zero_point"),
                       snapshot.get("weight_global_scale"))
    module.weight.requires_grad_(False)
    return error
