"""``AWQModifier``: activation-aware weight scaling (Lin et al., 2023), searched against the
scheme of the quantizer that follows it.

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        AWQModifier:
          duo_scaling: true
          n_grid: 20
          ignore: [lm_head]
        QuantizationModifier:                # or GPTQModifier: it gives the scheme
          targets: [Linear]
          ignore: [lm_head]
          scheme: W4A16

At the start of each block, for each mapping (a norm or Linear and the Linears reading its
output: ``mappings.py``), with ``x`` the mean ``|input|`` of each channel over the calibration
tokens and ``w`` the mean of each weight column's magnitude relative to its quantization group,
the candidates ``s = x^r / w^(1-r)`` (``duo_scaling``; ``x^r`` without it) for ``r`` on a grid of
``n_grid`` points in [0, 1] are normalised (``sqrt(max * min) = 1``). Each is scored by the
output of the smallest module holding the balance layers (the attention for q/k/v, the MLP for
gate/up, the layer itself for a single one), with the balance weights ``Q(W * s) / s`` (min-max
grid of the quantizer's scheme), against its full-precision output (mean squared error): run on
its cached inputs (``search_tokens`` of them, default 4096, spread over the set), or for a single
Linear computed exactly over every token from its inputs' Gram matrix. The best scales are
folded into the model: the quantizer then quantizes ``W * s`` and the smooth layer computes
``x / s``. ``s = 1`` is always a candidate, so AWQ never scores worse than plain rounding on the
calibration tokens.

Where the scheme rounds the balance layers' inputs at run time to as few bits as the weights or
fewer (dynamic activations: W8A8, NVFP4), they are rounded in the score too, as
``Q_a(x / s) * s``, and every owner is run (a Gram matrix cannot see that rounding): the scales
then move activation outliers into the weights where that pays, as SmoothQuant's do. An llmpress
addition (``score_rounded_inputs``): llm-compressor's loss, ``||Q(W s)(X / s) - W X||``, is
written with the weights' rounding alone. SmolLM2-135M, AWQ then round-to-nearest: W8A8 19.946 ->
19.862 (unquantized 19.640; llm-compressor 19.874), NVFP4 25.048 -> 24.543 (25.420). Inputs
rounded more finely than the weights (W4A8's int8 inputs of int4 weights) add little error and
the score keeps to the weights', exact over every token where the owner is one Linear: counting
them read 25.749 at W4A8 there, against 25.295 without (llm-compressor 25.403).

The arithmetic is llm-compressor's: ``x`` summed one sequence at a time in float32, ``w`` in
float64, so the scales are float64, and ``W * s`` rounded to the weight's dtype before it is
quantized, as it will be stored. It matters: symmetric grids put each group's largest weight on a
rounding tie (``|w| / scale = 7.5`` at 4 bits), so one unit in the last place of a scale moves
some weights by a whole step and reorders close candidates. With ``search_tokens: null`` and the
samples in llm-compressor's order, llmpress scores the first layer's candidates exactly as it
does (later layers differ by float rounding: it batches two samples, llm-compressor one) and
lands at 63.877 against its 63.882 (4 bits, tiny trained model).

``apply_clip: true`` (llmpress's addition, off by default as llm-compressor has none) then
searches each group's clipping range on the output, AutoAWQ's ``auto_clip`` (``clip.py``). On
the trained tiny model before round-to-nearest, 3 bits: perplexity 64.80 -> 64.31 (4 bits:
63.93 -> 63.89). Before GPTQ it hurts (3 bits 63.94 -> 63.99): GPTQ then reproduces the clipped
weights, so leave it off there.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import field_validator
from torch import nn
from tqdm.auto import tqdm

from llmpress.contract.modifier import MODIFIERS
from llmpress.errors import RecipeError
from llmpress.lifecycle.state import scheme_of
from llmpress.models.linear import input_major
from llmpress.modifiers.quantization import QuantizationModifier
from llmpress.modifiers.smoothing.awq_scores import LinearScore, RunScore, enclosing_module, scoring_owner, spread
from llmpress.modifiers.smoothing.base import SmoothingConfig, SmoothingModifier
from llmpress.modifiers.smoothing.clip import clip_, clip_group, clip_limits, group_grams
from llmpress.modifiers.smoothing.fold import apply_scales
from llmpress.modifiers.smoothing.mappings import Mapping
from llmpress.modifiers.smoothing.statistics import channel_statistics
from llmpress.parallel.distributed import world_size
from llmpress.quant.observers import fake_quantize_weight
from llmpress.quant.qdq import fake_quantize_activation
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["AWQModifier", "AWQModifierConfig"]

logger = logging.getLogger(__name__)


#: the fields of llm-compressor's older AWQModifier that described the scheme it quantized with
SCHEME_FIELDS = ("scheme", "targets", "config_groups", "kv_cache_scheme")


class AWQModifierConfig(SmoothingConfig):
    duo_scaling: bool | Literal["both"] = True
    n_grid: int = 20
    offload_device: Any = None  # accepted for llm-compressor's recipes; llmpress keeps one block's inputs as they are
    #: calibration tokens a candidate is scored on where that means running layers (batches spread
    #: over the set; None: all, as llm-compressor does). The activation statistics use every token,
    #: and a single-Linear owner is scored on all of them (from its inputs' Gram matrix) whatever
    #: this says. On the tiny model (4 bits, median of 4 sample orders) 4096 of 16384 tokens read
    #: 63.901 against 63.865 for all of them, in half the time (llm-compressor: 63.904 / 63.867).
    search_tokens: int | None = 4096
    #: after the scales, clip each group's weights where that lowers the output error (AutoAWQ's
    #: auto_clip; ``clip.py``): an llmpress addition, off as in llm-compressor; for RTN after it
    apply_clip: bool = False
    #: score each candidate with the balance layers' dynamic inputs rounded as the quantized model
    #: rounds them (``Q_a(x / s) Q(W s)``): None (the default) where the inputs are rounded no
    #: finer than the weights (W8A8, NVFP4), where that rounding is a large part of the error;
    #: True wherever inputs are rounded dynamically; False never (llm-compressor's loss)
    score_rounded_inputs: bool | None = None

    @field_validator("n_grid")
    @classmethod
    def _grid(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"n_grid must be at least 2, got {value}")
        return value


def grid(n_grid: int, duo_scaling: bool | str) -> list[tuple[float, bool]]:
    """The ``(ratio, duo)`` candidates, as llm-compressor sweeps them: with duo scaling the ratio
    0 without it first (the identity), ``both`` half the points each way."""
    if duo_scaling == "both":
        half = max(n_grid // 2, 2)
        return [(i / (half - 1), duo) for i in range(half) for duo in (False, True)]
    if duo_scaling:
        return [(0.0, False)] + [(i / max(n_grid - 2, 1), True) for i in range(n_grid - 1)]
    return [(i / (n_grid - 1), False) for i in range(n_grid)]


def column_means(layers: list[nn.Linear], args: QuantizationArgs) -> torch.Tensor:
    """Mean over all rows of the balance layers of ``|W|`` relative to the largest ``|W|`` of its
    quantization group (row for channel, the whole weight for tensor), per input column; summed
    in float64, so the candidate scales ``x^r / w^(1-r)`` are float64 as llm-compressor's are."""
    total, rows = 0, 0
    for layer in layers:
        w = layer.weight.detach().abs().float()
        out, cols = w.shape
        if args.is_grouped and cols % args.group_size == 0:
            w = w.reshape(out, cols // args.group_size, args.group_size)
            w = (w / (w.amax(dim=-1, keepdim=True) + 1e-6)).reshape(out, cols)
        elif args.strategy == QuantizationStrategy.TENSOR:
            w = w / (w.max() + 1e-6)
        else:  # channel (or a group that does not divide the columns: per row)
            w = w / (w.amax(dim=-1, keepdim=True) + 1e-6)
        total = total + w.sum(dim=0, dtype=torch.float64)
        rows += out
    return total / rows


def _rounded_inputs(layers: list[nn.Module], setting: bool | None) -> dict[nn.Module, QuantizationArgs]:
    """The balance layers whose inputs the quantized model rounds at run time, with the args it
    rounds them with (dynamic ones: per token, per group; NVFP4's against the input's own global
    scale here), so that a candidate is scored on what will be computed: the scales move
    activation outliers into the weights, and the search weighs both roundings. Static input
    scales are calibrated after AWQ, so those inputs are scored as they are. ``setting`` is
    ``score_rounded_inputs``: by default only inputs rounded to as few bits as the weights or
    fewer; finer ones (int8 inputs of int4 weights) add little error and cost the exact score."""
    rounded = {}
    for layer in layers:
        scheme = scheme_of(layer)
        args = None if scheme is None else scheme.input_activations
        if args is None or not args.dynamic or setting is False:
            continue
        weight_bits = scheme.weights.num_bits if scheme.weights is not None else 16
        if setting or args.num_bits <= weight_bits:
            rounded[layer] = args
    return rounded


def _quantized(layer: nn.Module) -> bool:
    scheme = scheme_of(layer)
    return scheme is not None and scheme.weights is not None


@MODIFIERS.register("AWQModifier")
class AWQModifier(SmoothingModifier):
    Config = AWQModifierConfig
    linear_sources = True

    def __init__(self, **fields: Any) -> None:
        """``AWQModifier(scheme=..., targets=...)``, as llm-compressor writes it in Python and in
        its older recipes: the transform, then a ``QuantizationModifier`` with that scheme (and
        AWQ's ``ignore``), its companion."""
        own = {key: fields.pop(key) for key in SCHEME_FIELDS if key in fields}
        super().__init__(**fields)
        self.quantizer = QuantizationModifier(**own, **({"ignore": fields["ignore"]} if "ignore" in fields else {})) if own else None
        if own:
            logger.info("AWQModifier with its own scheme: AWQModifier followed by QuantizationModifier(%s)",
                        ", ".join(f"{k}={v!r}" for k, v in own.items()))

    def companions(self) -> list:
        return [] if self.quantizer is None else [self.quantizer]

    def on_initialize(self, state) -> None:
        super().on_initialize(state)
        self.errors: list[tuple[str, float, float]] = []  # (smooth layer, error at s = 1, best error)
        self.clipped: list[str] = []  # layers apply_clip clipped
        self._told_exact = False
        self._note = ""

    def recipe_mappings(self, found: list[tuple[list[str], str]]) -> list:
        """``found`` in AWQ's recipe syntax: ``{smooth_layer, balance_layers}``."""
        return [{"smooth_layer": smooth, "balance_layers": balance} for balance, smooth in found]

    def usable(self, mappings: list[Mapping], skipped: list[str]) -> list[Mapping]:
        """Mappings whose quantized balance layers share one weight scheme. Balance layers no
        modifier quantizes (an MoE router the recipe ignores) take the scales and stay exact."""
        if mappings and not any(_quantized(m) for mp in mappings for m in mp.balance):
            raise RecipeError(
                "AWQModifier searches its scales against the weight scheme of the quantizer after it, and no module "
                "of its mappings has one",
                got=f"mappings {'; '.join(m.describe() for m in mappings)} without a quantization scheme",
                expected="a QuantizationModifier or GPTQModifier after AWQModifier in the same stage, targeting those Linears",
                fix="add e.g. QuantizationModifier: {scheme: W4A16, targets: [Linear], ignore: [lm_head]} after AWQModifier",
            )
        kept = []
        for mapping in mappings:
            weights = {scheme_of(m).weights.model_dump_json() for m in mapping.balance if _quantized(m)}
            if any(input_major(m) for m in mapping.balance):
                skipped.append(f"{mapping.describe()} (AWQ searches Linear weights; GPT-2's Conv1D is not one)")
            elif len(weights) != 1:
                skipped.append(f"{mapping.describe()} (its layers are not quantized with one weight scheme by a "
                               "modifier after AWQ in this stage)")
            else:
                kept.append(mapping)
                exact = [n for n, m in zip(mapping.balance_names, mapping.balance) if not _quantized(m)]
                if exact and not self._told_exact:
                    self._told_exact = True
                    logger.info("AWQModifier: balance layers no quantizer after AWQ rounds take the scales exactly "
                                "(a router the recipe ignores, say): %s", ", ".join(exact[:4]))
        return kept

    def smooth(self, block: CalibrationBlock, mappings: list[Mapping]) -> None:
        means = channel_statistics(block, mappings)
        prefix = self.prefix_of.get(block.module, "")
        start = len(self.errors)
        bar = tqdm(mappings, desc=f"AWQ layer {block.index}", leave=False, disable=True if len(mappings) < 2 else None)
        for mapping in bar:
            scales = self._search(block, mapping, means[mapping.smooth_name]["abs_mean"], prefix)
            apply_scales(mapping, scales)
        if self.config.apply_clip:
            self._clip(block, mappings, prefix)
        ratios = [best / first for _, first, best in self.errors[start:] if first > 0]
        self._note = f"AWQ error x{sum(ratios) / len(ratios):.2f}" if ratios else ""

    @torch.no_grad()
    def _search(self, block: CalibrationBlock, mapping: Mapping, x_mean: torch.Tensor, prefix: str) -> torch.Tensor:
        owner = scoring_owner(block, mapping.balance_names, prefix)
        originals = [layer.weight.detach().clone() for layer in mapping.balance]
        rounded_inputs = _rounded_inputs(mapping.balance, self.config.score_rounded_inputs)
        if owner is mapping.balance[0] and len(mapping.balance) == 1 and not rounded_inputs:
            score = LinearScore(block, owner, originals[0])
        else:
            score = RunScore(replace(block, inputs=spread(block.inputs, self._search_tokens)), owner)
        quantized = [_quantized(layer) for layer in mapping.balance]
        args = self._search_args(mapping.balance[quantized.index(True)])
        searched = [layer for layer, on in zip(mapping.balance, quantized) if on]
        w_mean = column_means(searched, args) if self.config.duo_scaling else None

        def put(scales: torch.Tensor) -> None:
            """The balance weights as the quantizer will round them with ``scales`` folded in:
            ``Q(W * s) / s``, ``W * s`` in the weight's own dtype as it will be stored."""
            for layer, weight, on in zip(mapping.balance, originals, quantized):
                if on:  # unquantized: Q(W s) / s is W itself
                    scaled = (weight.to(scales.dtype) * scales).to(weight.dtype)
                    on_grid = fake_quantize_weight(scaled.float(), args)
                    layer.weight.copy_((on_grid.to(scales.dtype) / scales).to(weight.dtype))

        scored: list[tuple[float, int, torch.Tensor]] = []  # (error, grid position, scales)
        current: list[torch.Tensor] = []

        def rounded_input(layer: nn.Module, inputs: tuple) -> tuple:
            """The input as the quantized model will multiply it: ``Q_a(x / s) * s`` against
            ``Q(W s) / s`` gives ``Q_a(x / s) Q(W s)``."""
            x, scales = inputs[0], current[0].to(inputs[0].dtype)
            return (fake_quantize_activation(x / scales, rounded_inputs[layer]) * scales, *inputs[1:])

        handles = [layer.register_forward_pre_hook(rounded_input) for layer in rounded_inputs]
        try:
            for position, (ratio, duo) in enumerate(grid(self.config.n_grid, self.config.duo_scaling)):
                scales = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4) if duo else x_mean.pow(ratio)
                scales = scales.clamp(min=1e-4)
                scales = scales / (scales.max() * scales.min()).sqrt()
                scales = torch.nan_to_num(scales, nan=1.0, posinf=1.0)
                put(scales)
                current[:] = [scales]
                scored.append((score(), position, scales))
        finally:
            for handle in handles:
                handle.remove()
            for layer, weight in zip(mapping.balance, originals):
                layer.weight.copy_(weight)
        finite = [c for c in scored if c[0] < float("inf")]
        chosen = min(finite, key=lambda c: (c[0], c[1])) if finite else None  # the first of equals, as llm-compressor
        first_error = scored[0][0]
        if chosen is None:  # every candidate gave a non-finite output
            self.errors.append((mapping.smooth_name, first_error, first_error))
            logger.warning("AWQ %s: no candidate scale gave a finite output; left unscaled", mapping.smooth_name)
            return torch.ones_like(x_mean)
        self.errors.append((mapping.smooth_name, first_error, chosen[0]))
        logger.debug("AWQ %s: output error %.3e at s = 1, %.3e at the chosen scales", mapping.smooth_name, first_error, chosen[0])
        return chosen[2]

    @torch.no_grad()
    def _clip(self, block: CalibrationBlock, mappings: list[Mapping], prefix: str) -> None:
        """Clip each balance layer where the module around it (attention, MLP) then computes
        closer to its full-precision output (``clip.py``)."""
        layers, sizes = [], []
        for layer in dict.fromkeys(m for mapping in mappings for m in mapping.balance if _quantized(m)):
            size = clip_group(self._search_args(layer), layer.weight.shape[-1])
            if size is not None:
                layers.append(layer)
                sizes.append(size)
        batches = spread(block.inputs, self._search_tokens)
        grams = group_grams(block, layers, sizes, batches)
        names = {m: n for n, m in block.module.named_modules()}
        scores: dict[nn.Module, RunScore] = {}
        for layer in layers:
            args = self._search_args(layer)
            limits = clip_limits(layer.weight, grams.pop(layer), args)
            around = enclosing_module(block.module, names[layer])
            if around not in scores:
                scores[around] = RunScore(replace(block, inputs=batches), around)
            original = layer.weight.detach().clone()
            try:
                layer.weight.copy_(fake_quantize_weight(original.float(), args).to(original.dtype))
                plain = scores[around]()
                layer.weight.copy_(original)
                clip_(layer, limits)
                clipped = layer.weight.detach().float().clone()
                layer.weight.copy_(fake_quantize_weight(clipped, args).to(original.dtype))
                better = scores[around]() < plain
            finally:
                layer.weight.copy_(original)
            if better:
                clip_(layer, limits)
                self.clipped.append(names[layer])

    def on_calibration_end(self, state) -> None:
        super().on_calibration_end(state)
        if self.config.apply_clip:
            logger.info("AWQModifier: clipping kept on %d layer(s): %s", len(self.clipped), ", ".join(self.clipped[:6]))

    @property
    def _search_tokens(self) -> int | None:
        """Tokens the searches run on, on this rank (each rank of a distributed run takes its
        share, so the search sees about ``search_tokens`` in all)."""
        tokens = self.config.search_tokens
        return None if tokens is None else max(1, tokens // world_size())

    @staticmethod
    def _search_args(layer: nn.Module) -> QuantizationArgs:
        return scheme_of(layer).weights.model_copy(update={"observer": "minmax", "observer_kwargs": {}})

    def step_note(self) -> str:
        return self._note
