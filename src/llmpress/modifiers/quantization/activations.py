"""Static input-activation ranges: observed on calibration data, turned into ``input_scale``.

Shared by every modifier that quantizes inputs statically (RTN, GPTQ): hooks record the running
min/max of each module's input; ``apply_input_quantization`` freezes the scale and switches the
module's input fake-quantization on (dynamic schemes need no observation).
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.quant.attach import enable_input_quantization, set_input_scale
from llmpress.quant.qdq import compute_qparams
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["InputRangeObserver"]


class InputRangeObserver:
    def __init__(self, modifier: str) -> None:
        self.modifier = modifier
        self.ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def observe(self, modules: dict[str, tuple[nn.Module, QuantizationScheme]]) -> None:
        """Start recording the input range of every module whose inputs are static."""
        for name, (module, scheme) in modules.items():
            args = scheme.input_activations
            if args is not None and not args.dynamic and name not in self._hooks:
                self._hooks[name] = module.register_forward_pre_hook(self._recorder(name))

    def _recorder(self, name: str):
        def record(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach()
            low, high = x.min().float(), x.max().float()
            if name in self.ranges:
                old_low, old_high = self.ranges[name]
                low, high = torch.minimum(low, old_low), torch.maximum(high, old_high)
            self.ranges[name] = (low, high)

        return record

    def apply_input_quantization(self, name: str, module: nn.Module, scheme: QuantizationScheme) -> None:
        """Stop observing ``module``, freeze its input scale, switch its input quantization on."""
        hook = self._hooks.pop(name, None)
        if hook is not None:
            hook.remove()
        args = scheme.input_activations
        if args is None:
            return
        if not args.dynamic:
            if name not in self.ranges:
                raise UnsupportedModelError(
                    f"{self.modifier}: module {name!r} saw no calibration input",
                    got="no forward pass through it",
                    expected="at least one calibration batch reaching every targeted module",
                    fix=f"add {name!r} to ignore, or check that the calibration data reaches it",
                )
            low, high = self.ranges.pop(name)
            scale, _ = compute_qparams(low.reshape(1), high.reshape(1), args)
            set_input_scale(module, scale)
        enable_input_quantization(module)

    def remove(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
