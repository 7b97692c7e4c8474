"""Static input-activation ranges: observed on calibration data, turned into ``input_scale``.

Shared by every modifier that quantizes inputs statically (RTN, GPTQ): ``record`` keeps the
running min/max of each module's observed input; ``apply_input_quantization`` freezes the scale
and switches the module's input fake-quantization on (dynamic schemes need no observation).
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.lifecycle.attach import enable_input_quantization, set_input_scale, set_module_buffer
from llmpress.parallel.distributed import is_distributed, max_across_ranks
from llmpress.quant.qdq import compute_qparams, global_scale_of
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["InputRangeObserver", "has_static_inputs"]


def has_static_inputs(scheme: QuantizationScheme) -> bool:
    """Whether the scheme's input scale comes from calibration data."""
    return scheme.input_activations is not None and scheme.input_activations.observes_range


class InputRangeObserver:
    def __init__(self, modifier: str) -> None:
        self.modifier = modifier
        self.ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, name: str, x: torch.Tensor) -> None:
        """Widen the input range of module ``name`` to cover ``x``."""
        low, high = torch.aminmax(x.detach())
        low, high = low.float(), high.float()
        if name in self.ranges:
            old_low, old_high = self.ranges[name]
            low, high = torch.minimum(low, old_low), torch.maximum(high, old_high)
        self.ranges[name] = (low, high)

    def reduce(self, names: list[str]) -> None:
        """Under torch.distributed: the ranges of ``names`` over every rank's batches (called by
        every rank with the same ``names``; a module one rank never saw takes the others')."""
        if not is_distributed() or not names:
            return
        bounds = torch.full((2, len(names)), float("-inf"))
        for i, name in enumerate(names):
            if name in self.ranges:
                low, high = self.ranges[name]
                bounds[0, i], bounds[1, i] = -low.cpu(), high.cpu()
        device = next((low.device for low, _ in self.ranges.values()), torch.device("cpu"))
        bounds = max_across_ranks(bounds.to(device)).cpu()
        for i, name in enumerate(names):
            if bounds[1, i] > float("-inf"):
                self.ranges[name] = (-bounds[0, i].to(device), bounds[1, i].to(device))

    def apply_input_quantization(self, name: str, module: nn.Module, scheme: QuantizationScheme) -> None:
        """Freeze the module's input scale and switch its input quantization on."""
        args = scheme.input_activations
        if args is None:
            return
        if args.observes_range:
            if name not in self.ranges:
                raise UnsupportedModelError(
                    f"{self.modifier}: module {name!r} saw no calibration input",
                    got="no forward pass through it",
                    expected="at least one calibration batch reaching every targeted module",
                    fix=f"add {name!r} to ignore, or check that the calibration data reaches it",
                )
            low, high = self.ranges.pop(name)
            if args.has_global_scale:  # NVFP4: group scales at run time, against this global scale
                set_module_buffer(module, "input_global_scale", global_scale_of(torch.maximum(low.abs(), high.abs())))
            else:
                scale, zero_point = compute_qparams(low.reshape(1), high.reshape(1), args)
                set_input_scale(module, scale, zero_point)
        enable_input_quantization(module)
