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

In a training loop (its first ``batch_start`` inside ``start``/``end``) it runs
quantization-aware training instead: fake-quantized forwards with straight-through gradients,
frozen onto the grid at ``end`` or ``finalize`` (see ``llmpress.lifecycle.qat``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.contract.modifier import MODIFIERS, Modifier, State
from llmpress.errors import SessionError, UnsupportedModelError
from llmpress.lifecycle.attach import (
    attach_scheme,
    detach_quantization,
    enable_input_quantization,
    freeze_weight,
    fused_families,
    same_grid,
    share_global_scales,
)
from llmpress.lifecycle.qat import enable_qat, freeze_qat, in_qat
from llmpress.lifecycle.state import Status, scheme_of, state_of
from llmpress.models.linear import input_major, is_linear
from llmpress.modifiers.mixed_precision.choose import schemes_at_initialize
from llmpress.modifiers.quantization.activations import InputRangeObserver, has_static_inputs
from llmpress.modifiers.quantization.config import QuantizationModifierConfig
from llmpress.modifiers.quantization.kv_cache import kv_cache_calibration
from llmpress.quant.groups import dividing_groups
from llmpress.quant.scheme import QuantizationScheme
from llmpress.targets import assign_by_targets, matches, name_conv1d_targets

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["QuantizationModifier", "assign_schemes", "names_of"]

logger = logging.getLogger(__name__)


def assign_schemes(
    model: nn.Module, schemes: list[QuantizationScheme], ignore: list[str], modifier: str
) -> dict[str, tuple[nn.Module, QuantizationScheme]]:
    """Attach to each targeted linear module the scheme whose targets match it most specifically.

    ``Linear`` targets cover GPT-2's ``Conv1D`` too; a Conv1D matched only that way carries the
    scheme with ``Conv1D`` added to its targets, so the saved config names it as
    compressed-tensors matches it. Matched modules that are not linear are skipped and reported
    once; a module whose weight is shared with another (tied embeddings) is untied first, so
    quantizing it leaves the other module intact. A group size that does not divide a module's
    inputs is made to (``quant/groups.py``). Raises ``UnsupportedModelError`` when nothing
    matches."""
    chosen = assign_by_targets(model, [(s.targets, s) for s in schemes], ignore, linear_alias=True)
    skipped = [f"{n} ({type(m).__name__})" for n, (m, _) in chosen.items() if not is_linear(m)]
    chosen = {n: (m, s) for n, (m, s) in chosen.items() if is_linear(m)}
    if skipped:
        logger.warning("%s: %d non-linear module(s) stay in full precision: %s (llmpress quantizes linear weights; "
                       "transformers + compressed-tensors cannot run a quantized Embedding either)", modifier, len(skipped),
                       ", ".join(skipped[:8]))
    unused = [s for s in schemes if not any(s is used for _, used in chosen.values())]
    if unused and chosen:
        logger.warning("%s: %d scheme(s) matched no module: targets %s", modifier, len(unused), [s.targets for s in unused])
    if not chosen:
        examples = [n for n, m in model.named_modules() if is_linear(m)][:5]
        raise UnsupportedModelError(
            f"{modifier} matched no Linear module",
            got=f"targets={[t for s in schemes for t in s.targets]}, ignore={ignore}",
            expected=f"targets that match Linear modules, such as {examples}",
            fix="use targets: [Linear] or module-name patterns like 're:.*proj$'",
        )
    chosen = name_conv1d_targets(chosen)
    # groups that divide each module's inputs, before any work: what vLLM and transformers load
    fitted = dividing_groups({n: (s, m.weight.shape[0 if input_major(m) else -1]) for n, (m, s) in chosen.items()}, modifier)
    chosen = {n: (m, fitted[n]) for n, (m, _) in chosen.items()}
    if any("Linear" in s.targets for s in schemes):
        _warn_uncovered_weights(model, chosen, ignore, modifier)
    untie_shared_weights(model, [m for m, _ in chosen.values()])
    for module, scheme in chosen.values():
        old = scheme_of(module)
        if old is not None and not same_grid(old, scheme):
            detach_quantization(module)  # an earlier stage's grid: its scales and input hook do not apply
        attach_scheme(module, scheme)
    return chosen


UNCOVERED_SHARE = 0.01  # of all parameters: below this, leftover matrices (routers, say) are not worth a word


def _warn_uncovered_weights(model: nn.Module, chosen: dict, ignore: list[str], modifier: str) -> None:
    """Say so when a recipe meant for every Linear leaves a real share of the model's weights in
    full precision because they live in other modules: fused mixture-of-experts blocks (transformers
    5 keeps as 3-D parameters the fused experts llmpress cannot split), for example."""
    total = sum(p.numel() for p in model.parameters())
    found: dict[str, tuple[str, int]] = {}
    for name, module in model.named_modules():
        if is_linear(module) or isinstance(module, nn.Embedding) or name in chosen or matches(name, module, ignore):
            continue
        size = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        if size:
            found[name] = (type(module).__name__, size)
    share = sum(size for _, size in found.values()) / max(total, 1)
    if share >= UNCOVERED_SHARE:
        examples = ", ".join(f"{n} ({kind})" for n, (kind, _) in list(found.items())[:4])
        logger.warning(
            "%s: %.0f%% of the model's weights are in modules that are not linear layers and stay in full precision: %s%s",
            modifier, 100 * share, examples, " ..." if len(found) > 4 else "",
        )


def frozen_by_an_earlier_stage(modules: dict[str, tuple[nn.Module, QuantizationScheme]]) -> set[str]:
    """The names of ``modules`` an earlier stage left frozen on the grid this stage gives them
    (``assign_schemes`` keeps such a module frozen). One-shot work leaves them as they are: rounded
    again, a rounded weight re-observes its range (7 or 8 steps where it was 7.5) and its scales move
    by 1/15; GPTQ would solve it again from that rounded weight."""
    return {name for name, (module, _) in modules.items() if state_of(module).status == Status.FROZEN}


def names_of(members: Iterable[nn.Module], modules: dict[str, tuple[nn.Module, QuantizationScheme]]) -> list[str]:
    """The names of ``modules`` that are among ``members``."""
    wanted = {id(m) for m in members}
    return [name for name, (module, _) in modules.items() if id(module) in wanted]


def finish_restored_layer(block: CalibrationBlock, pending: dict[str, tuple[nn.Module, QuantizationScheme]],
                          kv_cache: Any) -> None:
    """A resumed run put ``block`` back as an earlier run finished it (QuantizationModifier's and
    GPTQ's ``on_layer_restored``): its modules leave ``pending``, their input quantization goes
    on (a static input scale came back with the block), and so does its KV-cache quantizer."""
    for name in names_of(block.module.modules(), pending):
        module, _ = pending.pop(name)
        state_of(module).status = Status.FROZEN  # as the earlier run finished it
        enable_input_quantization(module)
    if kv_cache is not None:
        kv_cache.layer_restored(block)


def untie_shared_weights(model: nn.Module, modules: list[nn.Module], why: str = "quantized") -> int:
    """Give each of ``modules`` a weight of its own where it shares one with another module (the
    config, and a multimodal model's text config, then say the embeddings are not tied); returns
    how many it untied."""
    owners: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    untied = 0
    for module in modules:
        if owners.get(id(module.weight), 0) > 1:
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=module.weight.requires_grad)
            config = getattr(model, "config", None)
            text = getattr(config, "get_text_config", lambda: None)() if config is not None else None
            for each in (config, text):
                if each is not None and getattr(each, "tie_word_embeddings", False):
                    each.tie_word_embeddings = False
            logger.info("untied a shared weight so it can be %s on its own", why)
            untied += 1
    return untied


@MODIFIERS.register("QuantizationModifier")
class QuantizationModifier(Modifier):
    Config = QuantizationModifierConfig
    #: a GPTQ after it in its stage takes its scheme (llm-compressor's grammar); not AutoRound's
    gives_scheme_to_stage: ClassVar[bool] = True
    reduces_across_ranks = True  # static input ranges and KV-cache magnitudes reduced over the ranks

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data") if self.config.needs_calibration else ("model",)

    def calibration_targets(self) -> dict[str, nn.Module]:
        """Modules whose static input scale still needs calibration data."""
        if self.training:
            return {}
        return {n: m for n, (m, s) in self.pending.items() if has_static_inputs(s)}

    def observe(self, name: str, x: torch.Tensor) -> None:
        if name in self.pending:
            self.inputs.record(name, x)

    def runs_blocks(self) -> bool:
        kv_cache = getattr(self, "kv_cache", None)
        return kv_cache is not None and bool(kv_cache.pending) and not self.training

    def on_initialize(self, state: State) -> None:
        schemes = [self.with_defaults(s) for s in schemes_at_initialize(self.config, state, type(self).__name__)]
        self.modules = assign_schemes(state.model, schemes, self.config.ignore, type(self).__name__) if schemes else {}
        self.kv_cache = kv_cache_calibration(state.model, self.config, type(self).__name__)
        self.kept = frozen_by_an_earlier_stage(self.modules)
        for name, (module, _) in self.modules.items():
            if name not in self.kept:
                state_of(module).status = Status.PENDING  # a checkpoint saved meanwhile holds it rounded
        self.pending = {name: entry for name, entry in self.modules.items() if name not in self.kept}  # not quantized yet
        self.families = fused_families(state.model)  # NVFP4: q/k/v, gate/up share a global scale
        self.inputs = InputRangeObserver(type(self).__name__)
        self.calibrated = False
        self.training = False
        self.errors: dict[str, float] = {}

    def with_defaults(self, scheme: QuantizationScheme) -> QuantizationScheme:
        """The scheme as this modifier applies it (a subclass fills in what the recipe left out)."""
        return scheme

    def on_window_start(self, state: State) -> None:
        """Training reached the window: quantization-aware training from here on."""
        if self.kv_cache is not None:
            raise SessionError(
                f"{type(self).__name__}: kv_cache_scheme is calibrated one-shot, not during training",
                got="kv_cache_scheme in a training stage",
                expected="kv_cache_scheme in a one-shot stage",
                fix="move kv_cache_scheme to a one-shot stage (before or after training)",
            )
        unscaled = [
            n for n, (m, s) in self.pending.items()
            if s.input_activations is not None and s.input_activations.observes_range
            and getattr(m, "input_scale", getattr(m, "input_global_scale", None)) is None
        ]
        if unscaled:
            raise SessionError(
                f"{type(self).__name__}: quantization-aware training with static input activations needs "
                "their scales calibrated first",
                got=f"{len(unscaled)} module(s) without input_scale, e.g. {unscaled[0]!r}",
                expected="a scheme with dynamic activations (W8A8, W4A16), or input scales from a one-shot stage",
                fix="run a one-shot stage with the same scheme before the training stage",
            )
        self.training = True
        self.pending.update((name, self.modules[name]) for name in self.kept)  # trained from the earlier stage's grid
        for module, _ in self.pending.values():
            enable_qat(module)
            enable_input_quantization(module)
        logger.info("%s: quantization-aware training on %d module(s)", type(self).__name__, len(self.pending))

    def on_window_end(self, state: State) -> None:
        self.quantize_pending(list(self.pending))

    def on_modules_calibrated(self, state: State, block: CalibrationBlock, modules: list[nn.Module]) -> None:
        self.quantize_pending(names_of(modules, self.pending))

    def on_layer_calibrated(self, state: State, block: CalibrationBlock) -> None:
        """Quantize this block's modules now, so later blocks calibrate on quantized outputs."""
        self.quantize_pending(names_of(block.module.modules(), self.pending))
        if self.kv_cache is not None:
            self.kv_cache.layer_calibrated(block)

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        finish_restored_layer(block, self.pending, self.kv_cache)

    def on_calibration_end(self, state: State) -> None:
        self.calibrated = True
        self.quantize_pending(list(self.pending))
        if self.kv_cache is not None:
            self.kv_cache.calibration_end()

    def on_finalize(self, state: State) -> None:
        """Freeze whatever calibration did not (weights need no data; static inputs do)."""
        uncalibrated = self.pending or (self.kv_cache is not None and self.kv_cache.pending)
        if uncalibrated and not self.calibrated and not self.training and self.config.needs_calibration:
            raise SessionError(
                f"{type(self).__name__} cannot finalize: its static input scales were never calibrated",
                got="finalize() without calibration_start() / calibration_end()",
                expected="calibration_start(), forward passes over calibration_data, calibration_end()",
                fix="send those events before finalize(), or use llmpress.oneshot(...)",
            )
        self.quantize_pending(list(self.pending))

    def quantize_pending(self, names: list[str]) -> None:
        share_global_scales([self.pending[n][0] for n in names if n in self.pending], self.families)
        if not self.training:  # under torch.distributed: the ranges over every rank's batches
            self.inputs.reduce([n for n in names if n in self.pending and has_static_inputs(self.pending[n][1])])
        for name in tqdm(names, desc="Quantizing (RTN)", leave=False, disable=True if len(names) < 50 else None):
            module, scheme = self.pending.pop(name)
            if in_qat(module):
                self.errors[name] = freeze_qat(module)  # its input hook is on already
                continue
            if scheme.weights is not None:
                self.errors[name] = freeze_weight(module)
            else:
                state_of(module).status = Status.FROZEN  # inputs only: nothing to round
            self.inputs.apply_input_quantization(name, module, scheme)
            logger.debug("%s: %s relative error %.4f", type(self).__name__, name, self.errors.get(name, 0.0))
