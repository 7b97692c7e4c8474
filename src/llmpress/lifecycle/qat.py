"""Quantization-aware training: a fake-quantized forward with a straight-through gradient.

While QAT is on (``Status.TRAINING``), a quantized Linear computes ``linear(x, fq(W))`` where
``fq`` rounds the weight onto its grid; the gradient passes the rounding unchanged
(straight-through estimator), so the optimizer keeps moving the full-precision weight. Input
activations are fake-quantized the same way by the module's input hook.

QAT is a module swap, in place: the module's class becomes ``QATLinear`` (``QATConv1D``; for
another class, a ``QAT`` subclass made once), whose ``forward`` is the fake-quantized one, and
goes back when QAT ends. The module stays the same object, so its hooks, the optimizer's
parameters, FSDP's sharding and every reference a modifier holds stay valid, and a model in QAT
pickles and copies like any other.

Scales: a module that already carries ``weight_scale`` (quantized by an earlier one-shot stage,
RTN or GPTQ) keeps that grid, so the first QAT step computes exactly what the one-shot model
computes and training only moves weights between grid points. A module without one gets its
scales from the current weight at every forward (the scheme's observer). ``finalize`` rounds the
weights onto the grid for good.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpress.compat import own_buffers, own_parameters
from llmpress.lifecycle.attach import set_weight_qparams
from llmpress.lifecycle.state import Status, scheme_of, state_of, status_of
from llmpress.models import linear
from llmpress.models.linear import input_major
from llmpress.parallel.fsdp import whole
from llmpress.quant.observers import weight_global_scale, weight_qparams
from llmpress.quant.qdq import fake_quantize

__all__ = ["QATLinear", "disable_qat", "enable_qat", "freeze_qat", "in_qat", "qat_snapshot", "qat_weight"]


def _qparams(module: nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The module's fixed grid when it has one, else the observer's qparams for ``weight``; and
    NVFP4's global scale (the module's, else ``weight``'s own), None for other schemes."""
    args = scheme_of(module).weights
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
    args = scheme_of(module).weights
    if args is None:
        return weight
    scale, zero_point, global_scale = _qparams(module, weight)
    quantized = fake_quantize(weight, scale.to(weight.dtype), zero_point, args, global_scale)
    return weight + (quantized - weight).detach()


def _qat_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = qat_weight(module)
    return F.linear(x, weight.t() if input_major(module) else weight, module.bias)


def _qat_class(cls: type) -> type:
    """``cls``'s QAT class: a subclass whose forward is fake-quantized while the module is in
    training (a wrapper that subclassed it meanwhile, FSDP's, keeps it: it then runs ``cls``'s own
    forward once QAT ended)."""
    made = _QAT_CLASSES.get(cls)
    if made is None:
        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if status_of(self) == Status.TRAINING:
                return _qat_forward(self, x)
            return cls.forward(self, x)

        made = type(f"QAT{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__,
                                   "__doc__": f"{cls.__name__} in quantization-aware training (``enable_qat``)."})
        _QAT_CLASSES[cls], _BASE_OF[made] = made, cls
    return made


#: QAT classes by the class they stand in for, and back (made on first use)
_QAT_CLASSES: dict[type, type] = {}
_BASE_OF: dict[type, type] = {}
QATLinear = _qat_class(nn.Linear)


def __getattr__(name: str) -> type:
    """A QAT class by its name, as pickle looks it up: one made already, or ``QATConv1D`` (made
    here on first use, so that importing llmpress does not import transformers for it)."""
    for made in _BASE_OF:
        if made.__name__ == name:
            return made
    if name == "QATConv1D":
        return _qat_class(linear.Conv1D)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enable_qat(module: nn.Module) -> None:
    """Quantization-aware training from now on: the module's class becomes its QAT class."""
    if not isinstance(module, tuple(_BASE_OF)):
        module.__class__ = _qat_class(type(module))
    state_of(module).status = Status.TRAINING


def disable_qat(module: nn.Module) -> None:
    """The module computes its own forward again (its weight as it is: ``freeze_qat`` rounds it)."""
    base = _BASE_OF.get(type(module))
    if base is not None:
        module.__class__ = base
    state = state_of(module)  # (a wrapper's subclass of the QAT class stays: its forward reads the status)
    if state.status == Status.TRAINING:
        state.status = Status.PENDING


def in_qat(module: nn.Module) -> bool:
    return status_of(module) == Status.TRAINING


@torch.no_grad()
def qat_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's tensors as if QAT were frozen now, leaving the module untouched (what a
    checkpoint saved mid-training holds). A weight sharded by FSDP is taken whole (every rank
    calls), so its scales are those of the whole weight, the same on every rank."""
    weight = whole(module.weight.detach())
    args = scheme_of(module).weights
    local = {k: v.detach() for k, v in [*own_parameters(module).items(), *own_buffers(module).items()] if v is not None}
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
    if scheme_of(module).weights is None:
        state_of(module).status = Status.FROZEN
        return 0.0
    weight = whole(module.weight.detach())  # FSDP: the whole weight; set_weight_qparams writes back the shard
    snapshot = qat_snapshot(module)
    error = float((snapshot["weight"].float() - weight.float()).norm() / weight.float().norm().clamp(min=1e-12))
    set_weight_qparams(module, snapshot["weight"], snapshot["weight_scale"], snapshot.get("weight_zero_point"),
                       snapshot.get("weight_global_scale"))
    module.weight.requires_grad_(False)
    return error
