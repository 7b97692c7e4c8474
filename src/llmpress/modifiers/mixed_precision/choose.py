"""A scheme per module to fit a size: what a quantizing modifier with ``mixed_precision`` does at
``initialize``, before its algorithm (RTN, GPTQ, AWQ's quantizer) sees any scheme.

The choice is written into the model's config (``llmpress_mixed_precision``: the target, the
menu, and per group its modules, each option's bits and sensitivity, and the option chosen), so
the checkpoint says what was chosen and why; ``llmpress inspect`` reads it back.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from torch import nn

from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.lifecycle.compute_dtype import stored_dtype
from llmpress.lifecycle.records import config_entry
from llmpress.models.linear import is_linear
from llmpress.modifiers.mixed_precision.budget import Group, choose_options
from llmpress.modifiers.mixed_precision.measure import measure
from llmpress.modifiers.mixed_precision.menu import MixedPrecision, weight_bits
from llmpress.modifiers.mixed_precision.report import choice_summary
from llmpress.modifiers.mixed_precision.sensitivity import (
    Rounding,
    module_groups,
    round_to_nearest,
    sequences,
    shape_of,
)
from llmpress.quant.groups import EXPERT_NAME, name_targets, shared_columns
from llmpress.quant.scheme import QuantizationScheme
from llmpress.targets import assign_by_targets

__all__ = ["RECORD_KEY", "choose_schemes", "record_of", "schemes_at_initialize"]

logger = logging.getLogger(__name__)

#: config.json key of the record of a mixed-precision choice
RECORD_KEY = "llmpress_mixed_precision"


def schemes_at_initialize(config: Any, state: Any, modifier: str, rounding: Rounding = round_to_nearest) -> list[QuantizationScheme]:
    """A quantizing modifier's schemes (``SchemeFields``) as it starts: with ``mixed_precision``,
    chosen now on the model and its calibration data, each option's error made by ``rounding``
    (the modifier's own algorithm); otherwise the config's own."""
    if config.mixed_precision is None:
        return config.resolved_schemes()
    chosen = choose_schemes(state.model, state.calibration_data, config.mixed_precision, config.targets, config.ignore, modifier,
                            rounding)
    return [config.with_observers(scheme) for scheme in chosen]  # the recipe's observer overrides, as on a uniform scheme


def choose_schemes(model: nn.Module, calibration_data: Any, mixed: MixedPrecision, targets: list[str], ignore: list[str],
                   modifier: str, rounding: Rounding = round_to_nearest) -> list[QuantizationScheme]:
    """The schemes of ``mixed``'s menu, each aimed at the modules (by name) it was chosen for; the
    modules left as they are get none. Records the choice in ``model.config``."""
    matched = assign_by_targets(model, [(targets, None)], ignore, linear_alias=True)
    modules = {name: module for name, (module, _) in matched.items() if is_linear(module)}
    if not modules:
        raise UnsupportedModelError(f"{modifier}: mixed precision matched no Linear module", got=f"targets={targets}, ignore={ignore}",
                                    expected="targets that match Linear modules", fix="use targets: [Linear]")
    weights = sum(rows_ * columns for rows_, columns in (shape_of(modules[n]) for n in modules))
    budget = _budget(model, mixed, modules, weights)
    options = mixed.options(budget / weights)
    widths = shared_columns({name: shape_of(module)[1] for name, module in modules.items()})  # what each one's groups divide
    bits = {name: _option_bits(module, options, widths[name]) for name, module in modules.items()}
    _check_budget(mixed, bits, options, budget, weights)  # before the measure: a too low target fails at once
    rows = sequences(calibration_data, mixed.samples)
    logger.info("%s: measuring the sensitivity of %d modules on %d sequences", modifier, len(modules), len(rows))
    measured = measure(model, modules, rows, options, rounding)
    groups = [_group(members, modules, bits, measured.costs, options)
              for members in module_groups(modules, measured.input_of, mixed.experts)]
    picks = choose_options(groups, budget)
    spent = sum(g.bits[p] for g, p in zip(groups, picks))
    counts = Counter(options[p].name for g, p in zip(groups, picks) for _ in g.modules)
    logger.info("%s: mixed precision chose %s: %.3f bits per weight on average (%s)", modifier,
                ", ".join(f"{name} for {n} module(s)" for name, n in counts.most_common()), spent / weights, _target(mixed))
    record = _record(model, mixed, options, groups, picks, spent / weights, len(rows))
    logger.info("%s: the choice by layer (llmpress inspect shows it again, --plot draws it):\n%s", modifier, "\n".join(choice_summary(record)[1:]))
    chosen: dict[int, list[str]] = {}
    for group, pick in zip(groups, picks):
        chosen.setdefault(pick, []).extend(group.modules)
    return [options[k].scheme.model_copy(update={"targets": _targets(members, list(modules))})
            for k, members in sorted(chosen.items()) if options[k].scheme is not None]


def _option_bits(module: nn.Module, options: list, divides: int) -> list[int]:
    """The bits ``module``'s weight takes under each option, as the checkpoint stores it (its
    groups made to divide ``divides``)."""
    rows, columns = shape_of(module)
    dtype = stored_dtype(module)
    return [weight_bits(option.scheme, rows, columns, dtype, divides) for option in options]


def _group(members: list[str], modules: dict[str, nn.Module], bits: dict[str, list[int]], table: dict[str, list[float]],
           options: list) -> Group:
    weights = sum(rows * columns for rows, columns in (shape_of(modules[name]) for name in members))
    summed = [sum(bits[name][k] for name in members) for k in range(len(options))]
    sensitivity = [sum(table[name][k] for name in members) for k in range(len(options))]
    return Group(members, summed, sensitivity, weights)


#: bytes a tensor's entry takes in a safetensors header beyond its name (dtype, shape, offsets), at most
_HEADER_ENTRY = 128
#: tensors a quantized module may write: packed weight, scale, zero point, shape (int64 x 2), group indices
_QUANTIZED_TENSORS = 5


def _budget(model: nn.Module, mixed: MixedPrecision, modules: dict[str, nn.Module], weights: int) -> float:
    """The bits the targeted weights may take: ``average_bits`` of each, or what ``size`` (the
    safetensors files' bytes) leaves once every other tensor of the model is counted as it is
    stored (an embedding tied to a targeted head included: the checkpoint stores both), and
    every tensor's header entry and each quantized module's ``weight_shape``."""
    if mixed.average_bits is not None:
        return mixed.average_bits * weights
    chosen = {f"{name}.weight" for name in modules}  # by name: a head tied to the embeddings is untied when quantized
    others: dict[int, tuple[str, Any]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if name not in chosen:
            others.setdefault(id(tensor), (name, tensor))
    fixed = sum(t.numel() * t.element_size() + len(n) + _HEADER_ENTRY for n, t in others.values())
    fixed += sum(16 + _QUANTIZED_TENSORS * (len(n) + 16 + _HEADER_ENTRY) for n in modules)
    return 8 * (mixed.size_bytes() - fixed)


def _check_budget(mixed: MixedPrecision, bits: dict[str, list[int]], options: list, budget: float, weights: int) -> None:
    """Refuse a target that even every module at its cheapest option (``bits``: each module's
    bits per option) overshoots, said in average bits per targeted weight (what ``average_bits``
    counts, and what a ``size`` leaves them)."""
    cheapest: dict[str, int] = {}
    least = 0
    for each in bits.values():
        least += min(each)
        at = options[each.index(min(each))].name
        cheapest[at] = cheapest.get(at, 0) + 1
    if least <= budget:
        return
    at_cheapest = ", ".join(f"{name} for {n}" for name, n in cheapest.items())
    if mixed.average_bits is not None:
        got, expected = f"average_bits {mixed.average_bits}", f"at least {least / weights:.3f} bits per targeted weight"
    else:  # the budget is what the size leaves the targeted weights, in bits
        smallest = mixed.size_bytes() - (budget - least) / 8
        got, expected = f"size {mixed.size}", f"at least {smallest / 1e6:.2f} MB"
    raise RecipeError(
        "mixed precision: the target is below the cheapest scheme of the menu", got=got,
        expected=f"{expected} (every module at its cheapest: {at_cheapest}; the menu: {', '.join(o.name for o in options)})",
        fix="raise the target, or add a cheaper scheme to the menu (schemes: [...] in the recipe, --schemes on the command line)",
    )


def _target(mixed: MixedPrecision) -> str:
    return f"target {mixed.average_bits}" if mixed.average_bits is not None else f"to fit {mixed.size}"


def _targets(names: list[str], all_names: list[str]) -> list[str]:
    """Exact module names, except the experts': one pattern for all of a model's experts where
    they share the scheme, else one per experts block (``name_targets``: a block of 256 experts
    is one target, not 768)."""
    experts = [n for n in names if EXPERT_NAME.fullmatch(n)]
    return [n for n in names if not EXPERT_NAME.fullmatch(n)] + (name_targets(experts, all_names) if experts else [])


def _record(model: nn.Module, mixed: MixedPrecision, options: list, groups: list[Group], picks: list[int],
            average: float, sequences: int) -> dict[str, Any]:
    """The choice as ``config.json`` keeps it (on ``model.config`` where there is one);
    ``sequences``: how many the sensitivities were measured on (``samples`` at most)."""
    target = {"average_bits": mixed.average_bits} if mixed.average_bits is not None else {"size": mixed.size}
    record = {
        "target": target,
        "average_bits": round(average, 4),
        "menu": [o.name for o in options],
        "samples": sequences,
        "measure": "1/2 sum_i g_i dW_i H dW_i^T (g: squared output gradients, H: input Hessian, dW: the algorithm's rounding error)",
        "groups": [{"modules": g.modules, "chosen": options[p].name, "weights": g.weights, "bits": g.bits,
                    "sensitivity": [float(f"{s:.4g}") for s in g.sensitivity]} for g, p in zip(groups, picks)],
    }
    config = getattr(model, "config", None)
    if config is not None:
        setattr(config, RECORD_KEY, record)
    return record


def record_of(config: Any) -> dict[str, Any] | None:
    """The mixed-precision record of a model config (an object or a config.json dict), if any."""
    return config_entry(config, RECORD_KEY)
