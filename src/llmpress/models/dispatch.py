"""``dispatch_for_generation``: the step llm-compressor's examples take between ``oneshot`` and
``model.generate``, under the same name, so those scripts run with their imports changed."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["dispatch_for_generation"]


def dispatch_for_generation(model: nn.Module) -> nn.Module:
    """``model`` in eval mode on the CUDA GPU(s) where there are any (spread over them by
    accelerate where it does not fit one), else where it is (after ``oneshot`` an llmpress
    model is a plain module in memory: nothing to undo). Returns the model."""
    model.eval()
    if not torch.cuda.is_available():
        return model
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return model.to("cuda")
    no_split = getattr(model, "_no_split_modules", None) or []
    return dispatch_model(model, infer_auto_device_map(model, no_split_module_classes=no_split))
