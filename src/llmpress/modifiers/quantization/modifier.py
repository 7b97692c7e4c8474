"""``QuantizationModifier``: round-to-nearest quantization of weights (and activations).

Example recipe::

    quant_stage:
      quant_modifiers:
        QuantizationModifier:
          targets: [Linear]
          ignore: [lm_head]
          scheme: W4A16

Weights are quantized at ``calibration_end`` with their observer (minmax or mse). Static input
activations (``FP8``) need ``calibration_data``: their ranges are observed on it between
``calibration_start`` and ``calibration_end``. Dynamic activations (``W8A8``) need nothing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import UnsupportedModelError
from llmpress.modifiers.base import MODIFIERS, Modifier, State
from llmpress.modifiers.quantization.config import QuantizationModifierConfig
from llmpress.quant.attach import (
    attach_scheme,
    enable_input_quantization,
    freeze_weight,
    set_input_scale,
)
from llmpress.quant.qdq import compute_qparams
from llmpress.quant.scheme import QuantizationScheme
from llmpress.targets import match_modules

__all__ = ["QuantizationModifier", "assign_schemes"]

logger = logging.getLogger(__name__)


def assign_schemes(
    model: nn.Module, schemes: list[QuantizationScheme], ignore: list[str], modifier: str
) -> dict[str, tuple[nn.Module, QuantizationScheme]]:
    """Attach each scheme to the Linear modules its targets match (first scheme wins).

    Matched modules that are not ``nn.Linear`` are skipped and reported once. Raises
    ``UnsupportedModelError`` when nothing matches."""
    chosen: dict[str, tuple[nn.Module, QuantizationScheme]] = {}
    skipped: list[str] = []
    for scheme in schemes:
        for name, module in match_modules(model, scheme.targets, ignore):
            if name in chosen:
                continue
            if not isinstance(module, nn.Linear):
                skipped.append(f"{name} ({type(module).__name__})")
                continue
            attach_scheme(module, scheme)
            chosen[name] = (module, scheme)
    if skipped:
        logger.warning("%s: skipped %d non-Linear module(s): %s", modifier, len(skipped), ", ".join(skipped[:8]))
    if not chosen:
        examples = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:5]
        raise UnsupportedModelError(
            f"{modifier} matched no Linear module",
            got=f"targets={[t for s in schemes for t in s.targets]}, ignore={ignore}",
            expected=f"targets that match Linear modules, such as {examples}",
            fix="use targets: [Linear] or module-name patterns like 're:.*proj$'",
        )
    return chosen


@MODIFIERS.register("QuantizationModifier")
class QuantizationModifier(Modifier):
    Config = QuantizationModifierConfig
    events = frozenset({"calibration_start", "calibration_end"})

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data") if self.config.needs_calibration else ("model",)

    @property
    def needs_calibration_forward(self) -> bool:
        return self.config.needs_calibration

    def on_initialize(self, state: State) -> None:
        self.modules = assign_schemes(
            state.model, self.config.resolved_schemes(), self.config.ignore, type(self).__name__
        )
        self._ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.errors: dict[str, float] = {}

    def on_calibration_start(self, state: State) -> None:
        for name, (module, scheme) in self.modules.items():
            args = scheme.input_activations
            if args is not None and not args.dynamic:
                self._hooks.append(module.register_forward_pre_hook(self._observer(name)))

    def _observer(self, name: str):
        def observe(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach()
            low, high = x.min().float(), x.max().float()
            if name in self._ranges:
                old_low, old_high = self._ranges[name]
                low, high = torch.minimum(low, old_low), torch.maximum(high, old_high)
            self._ranges[name] = (low, high)

        return observe

    def on_calibration_end(self, state: State) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for name, (module, scheme) in tqdm(self.modules.items(), desc="Quantizing (RTN)", leave=False):
            self.quantize_module(name, module, scheme)

    def quantize_module(self, name: str, module: nn.Module, scheme: QuantizationScheme) -> None:
        """Freeze one module's weight on its grid and switch on its input quantization."""
        if scheme.weights is not None:
            self.errors[name] = freeze_weight(module)
        args = scheme.input_activations
        if args is not None:
            if not args.dynamic:
                if name not in self._ranges:
                    raise UnsupportedModelError(
                        f"{type(self).__name__}: module {name!r} saw no calibration input",
                        got="no forward pass through it",
                        expected="at least one calibration batch reaching every targeted module",
                        fix=f"add {name!r} to ignore, or check that the calibration data reaches it",
                    )
                low, high = self._ranges[name]
                scale, _ = compute_qparams(low.reshape(1), high.reshape(1), args)
                set_input_scale(module, scale)
            enable_input_quantization(module)
        logger.debug("%s: %s relative error %.4f", type(self).__name__, name, self.errors.get(name, 0.0))
