"""``AutoRoundModifier``: weights rounded block by block to reproduce each block's output.

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        AutoRoundModifier:
          iters: 200
          ignore: [lm_head]
          scheme: W4A16

As each block of the layerwise pipeline starts, its quantized Linears' rounding offsets and range
scales are tuned by signed gradient descent (``tuning.py``, ``rounding.py``) so that the block on
the compressed model's inputs gives what the unquantized block gives on the unquantized model's;
the weights are then on their grid, with the scale and zero point the tuning found, and the block
calibrates as usual (static input ranges are observed afterwards, on the tuned weights). Any
grid llmpress stores: integers (symmetric or not, per channel, group or tensor), fp4 (NVFP4,
MXFP4) and fp8. Modules outside the blocks (a quantized ``lm_head``) and models without repeated
blocks are rounded to nearest, and the run says so.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from llmpress.contract.modifier import MODIFIERS, State
from llmpress.errors import SessionError
from llmpress.lifecycle.attach import scale_dtype_for, set_weight_qparams, share_global_scales
from llmpress.lifecycle.compute_dtype import stored_dtype
from llmpress.modifiers.autoround.config import AutoRoundModifierConfig
from llmpress.modifiers.autoround.record import RECORD_KEY, autoround_record
from llmpress.modifiers.autoround.rounding import TunedWeight
from llmpress.modifiers.autoround.tuning import tune_block
from llmpress.modifiers.quantization.activations import has_static_inputs
from llmpress.modifiers.quantization.modifier import QuantizationModifier, names_of
from llmpress.quant.observers import searched_range
from llmpress.quant.scheme import QuantizationScheme

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["AutoRoundModifier"]

logger = logging.getLogger(__name__)


@MODIFIERS.register("AutoRoundModifier")
class AutoRoundModifier(QuantizationModifier):
    Config = AutoRoundModifierConfig
    gives_scheme_to_stage = False  # it is the algorithm: a GPTQ after it brings its own scheme

    def on_initialize(self, state: State) -> None:
        super().on_initialize(state)
        self.tuned: set[str] = set()
        self.fp_hidden: list[torch.Tensor] | None = None  # the unquantized model's stream, block to block
        self.losses: dict[int, tuple[float, float, int]] = {}  # block: (untuned rounding's loss, best, best step)
        self.seconds = 0.0
        self._note = ""
        self.resumed = False

    def with_defaults(self, scheme: QuantizationScheme) -> QuantizationScheme:
        """Weights the tuning does not reach (``iters: 0``, modules outside the blocks) round
        over the searched range, auto-round's "optimized RTN"; ``disable_opt_rtn``: min/max."""
        if scheme.weights is None or self.config.disable_opt_rtn:
            return scheme
        return scheme.model_copy(update={"weights": searched_range(scheme.weights)})

    def on_window_start(self, state: State) -> None:
        raise SessionError(
            "AutoRoundModifier is one-shot: it tunes each block on calibration data",
            got="AutoRoundModifier in a training stage",
            expected="a one-shot stage (llmpress.oneshot, or calibration events)",
            fix="use QuantizationModifier for quantization-aware training",
        )

    def on_block_start(self, state: State, block: CalibrationBlock) -> None:
        if self.config.iters == 0:
            return
        start = time.perf_counter()
        names = [n for n in names_of(block.module.modules(), self.pending) if self.pending[n][1].weights is not None]
        share_global_scales([self.pending[n][0] for n in names], self.families)  # NVFP4: q/k/v, gate/up share one
        modules = {}
        for name in names:
            module, scheme = self.pending[name]
            tuned = TunedWeight(module.weight, scheme.weights, getattr(module, "weight_global_scale", None),
                                scale_dtype_for(scheme.weights, stored_dtype(module)))
            modules[module] = (tuned, scheme.input_activations)
        fp_hidden = self.fp_hidden if self.fp_hidden is not None and len(self.fp_hidden) == len(block.inputs) else None
        bits = min((s.weights.num_bits for _, s in (self.pending[n] for n in names)), default=8)
        result = tune_block(block, modules, fp_hidden, self.config.iters, self.config.batch_size,
                            self.config.step_size(bits), self.config.seed, self.config.autocast)
        self.fp_hidden = result.fp_outputs
        for name in names:
            module, scheme = self.pending[name]
            tuned = modules[module][0]
            weight, scale, zero_point = tuned.final()
            set_weight_qparams(module, weight, scale, zero_point)
            self.errors[name] = float((weight - tuned.weight).norm() / tuned.weight.norm().clamp(min=1e-12))
            self.tuned.add(name)
        self.seconds += time.perf_counter() - start
        if names:
            self.losses[block.index] = (result.first_loss, result.best_loss, result.best_step)
            self._note = f"AutoRound loss {result.first_loss:.3g} -> {result.best_loss:.3g} (step {result.best_step})"
            logger.info("%s layer %d: %d module(s), %s, %.1fs", type(self).__name__, block.index, len(names), self._note,
                        time.perf_counter() - start)

    def step_note(self) -> str:
        return self._note

    def resume_note(self) -> dict[str, list]:
        return {str(index): list(losses) for index, losses in self.losses.items()}

    def take_resume_note(self, note: dict[str, list] | None) -> None:
        self.losses.update({int(index): (float(a), float(b), int(c)) for index, (a, b, c) in (note or {}).items()})

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        super().on_layer_restored(state, block)
        if not self.resumed:
            logger.warning("%s: a resumed run tunes the layers after the restored ones toward the unquantized layers on the "
                           "restored layers' outputs (the unquantized model's own are not kept): the checkpoint differs slightly "
                           "from an uninterrupted run's", type(self).__name__)
        self.resumed = True

    def quantize_pending(self, names: list[str]) -> None:
        """Tuned modules are on their grid already: only their input quantization is left."""
        done = [n for n in names if n in self.tuned and n in self.pending]
        self.inputs.reduce([n for n in done if has_static_inputs(self.pending[n][1])])
        for name in done:
            module, scheme = self.pending.pop(name)
            self.inputs.apply_input_quantization(name, module, scheme)
        super().quantize_pending([n for n in names if n not in self.tuned])

    def on_calibration_end(self, state: State) -> None:
        rounded = [n for n, (_, s) in self.pending.items() if s.weights is not None]
        super().on_calibration_end(state)
        self.fp_hidden = None
        if self.config.iters and rounded:
            logger.warning("%s: %d module(s) outside the model's repeated blocks were rounded to nearest, not tuned: %s",
                           type(self).__name__, len(rounded), ", ".join(rounded[:8]))
        if self.losses and state.model is not None and getattr(state.model, "config", None) is not None:
            setattr(state.model.config, RECORD_KEY, autoround_record(self.config.iters, self.config.batch_size, self.losses))
        if self.losses:
            cut = [1 - best / first for first, best, _ in self.losses.values() if first > 0]
            logger.info("%s: %d layer(s) tuned in %.1fs (%d steps each); the block loss fell by %.0f%% on average "
                        "from the untuned rounding", type(self).__name__, len(self.losses), self.seconds, self.config.iters,
                        100 * sum(cut) / max(len(cut), 1))
