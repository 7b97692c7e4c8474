"""Group sizes a deployed checkpoint loads with: each group whole.

compressed-tensors (transformers) and vLLM refuse a weight whose input features are not a
multiple of its group size ("column shape must be divisible by the given group_size",
"input_size_per_partition=576 ... is not divisible by group_size=128"), where llmpress itself
would round a shorter last group. llm-compressor refuses such a recipe up front. llmpress
instead gives those modules the largest group that divides their inputs and that vLLM's int4
kernels take (64, then 32, for a requested 128), says so before any work, and writes them as a
config group of their own, targeted by name (a name target is more specific than the class
target ``Linear``, for compressed-tensors and vLLM alike). An MoE block's experts take one group
for all their projections (vLLM serves them as one layer of one scheme), and their targets name
them as experts (``name_targets``). Where no such group exists (fp4's
fixed groups of 16 or 32, inputs of a width like 200) it says so before calibrating, naming the
modules, why, and what to write instead, and keeps llmpress's shorter last group (which
llmpress reads back).
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict

from llmpress.quant.scheme import QuantizationArgs, QuantizationScheme, QuantizationStrategy

__all__ = ["EXPERT_NAME", "SMALLER_GROUPS", "dividing_groups", "fitted_weight_group", "name_targets", "shared_columns", "whole_groups"]

logger = logging.getLogger(__name__)

#: the group sizes a too-wide int group falls back to, largest first (vLLM's Marlin and CPU int4
#: kernels take 32, 64 and 128)
SMALLER_GROUPS = (128, 64, 32)

#: an expert's module: (its experts block, its own name in the expert)
EXPERT_NAME = re.compile(r"(.*\.experts)\.\d+\.(.+)")


def dividing_groups(modules: dict[str, tuple[QuantizationScheme, int]], modifier: str) -> dict[str, QuantizationScheme]:
    """``{module name: (scheme, input features)}`` -> each module's scheme, with its int weight
    group made to divide its inputs where the requested one does not (one new scheme, named by
    its modules, per scheme and group). The modules no group fits keep theirs, with a warning
    that says why vLLM will not load them and what to write instead."""
    out = {name: scheme for name, (scheme, _) in modules.items()}
    moved: dict[tuple[int, int], list[str]] = defaultdict(list)
    refused: list[tuple[str, int, QuantizationArgs, str]] = []
    shared = shared_columns({name: columns for name, (_, columns) in modules.items()})
    for name, (scheme, columns) in modules.items():
        for args, what, width in ((scheme.weights, "weights", shared[name]), (scheme.input_activations, "input activations", columns)):
            if args is None or not args.is_grouped or width % args.group_size == 0 or (what != "weights" and width < args.group_size):
                continue  # (inputs narrower than one group: compressed-tensors and vLLM take them whole)
            group = _fitting_group(args, width) if what == "weights" else None
            if group is None:
                refused.append((name, width, args, what))
            else:
                moved[(id(scheme), group)].append(name)
    if refused:
        _warn_unloadable(refused, modifier)
    schemes = {id(s): s for s, _ in modules.values()}
    for (key, group), names in moved.items():
        scheme = schemes[key]
        fitted = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": group}),
                                           "targets": name_targets(names, list(modules))})
        for name in names:
            out[name] = fitted
        widths = sorted({modules[n][1] for n in names if modules[n][1] % scheme.weights.group_size})
        siblings = any(modules[n][1] % scheme.weights.group_size == 0 for n in names)
        logger.warning(
            "%s: groups of %d do not divide the %s input features of %d module(s) (%s): they use groups of %d, written as their own "
            "config group (compressed-tensors and vLLM refuse a shorter last group)%s",
            modifier, scheme.weights.group_size, "/".join(map(str, widths)), len(names), _examples(names), group,
            "; the other projections of their experts blocks too (vLLM serves a block's experts as one layer)" if siblings else "",
        )
    return out


def whole_groups(scheme: QuantizationScheme, columns: int) -> bool:
    """Whether compressed-tensors and vLLM take ``scheme``'s groups over ``columns`` input
    features: every grouped weight whole, grouped inputs whole or narrower than one group."""
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is not None and weights.is_grouped and columns % weights.group_size:
        return False
    return not (inputs is not None and inputs.is_grouped and columns > inputs.group_size and columns % inputs.group_size)


def fitted_weight_group(scheme: QuantizationScheme, columns: int) -> QuantizationScheme:
    """``scheme`` with the int weight group ``dividing_groups`` gives a module of ``columns``
    input features (the scheme itself where its groups divide them or none fits), said nowhere:
    for estimating a scheme's size and error before it is chosen."""
    weights = scheme.weights
    if weights is None or not weights.is_grouped or columns % weights.group_size == 0:
        return scheme
    group = _fitting_group(weights, columns)
    return scheme if group is None else scheme.model_copy(update={"weights": weights.model_copy(update={"group_size": group})})


def _fitting_group(args: QuantizationArgs, columns: int) -> int | None:
    if args.is_float or args.strategy != QuantizationStrategy.GROUP:
        return None  # fp4's groups are the format's own
    return next((g for g in SMALLER_GROUPS if g < args.group_size and columns % g == 0), None)


def shared_columns(columns: dict[str, int]) -> dict[str, int]:
    """``{module name: input features}`` -> the input features each module's weight groups must
    divide: its own, or for an expert's module the greatest common divisor of its experts block's
    (vLLM serves a block's gate, up and down projections as one layer, of one scheme)."""
    blocks: dict[str, int] = {}
    for name, width in columns.items():
        found = EXPERT_NAME.fullmatch(name)
        if found:
            blocks[found.group(1)] = math.gcd(blocks.get(found.group(1), 0), width)
    return {name: blocks[found.group(1)] if (found := EXPERT_NAME.fullmatch(name)) else width for name, width in columns.items()}


def name_targets(names: list[str], all_names: list[str]) -> list[str]:
    """Targets that match exactly ``names`` among ``all_names``: a pattern on their last names
    (``re:.*\\.(q_proj|k_proj)$``) where it picks no other module, else the names themselves.
    Experts' modules are named as experts (``re:.*\\.experts\\.\\d+\\.(down_proj|gate_proj|up_proj)$``,
    else one such pattern per experts block): transformers 5 builds an MoE block's experts as one
    module and takes their scheme from the config group whose ``re:`` target names experts."""
    experts = [n for n in names if EXPERT_NAME.fullmatch(n)]
    others = [n for n in names if not EXPERT_NAME.fullmatch(n)]
    targets: list[str] = []
    if others:
        pattern = [_pattern(others, r".*\.")]
        targets += pattern if all(n.count(".") for n in others) and _picks(pattern, all_names) == set(others) else sorted(others)
    if experts:
        blocks = sorted({EXPERT_NAME.fullmatch(n).group(1) for n in experts})
        candidates = ([_pattern(experts, r".*\.experts\.\d+\.")],
                      [_pattern([n for n in experts if n.startswith(b + ".")], re.escape(b) + r"\.\d+\.") for b in blocks])
        targets += next((c for c in candidates if _picks(c, all_names) == set(experts)), sorted(experts))
    return targets


def _pattern(names: list[str], prefix: str) -> str:
    """``re:`` + ``prefix`` + the names' last parts (an expert's: its name in the expert)."""
    last = sorted({found.group(2) if (found := EXPERT_NAME.fullmatch(n)) else n.rpartition(".")[2] for n in names})
    return "re:" + prefix + "(" + "|".join(map(re.escape, last)) + r")$"


def _picks(patterns: list[str], all_names: list[str]) -> set[str]:
    return {n for n in all_names if any(re.fullmatch(p.removeprefix("re:"), n) for p in patterns)}


def _warn_unloadable(refused: list[tuple[str, int, QuantizationArgs, str]], modifier: str) -> None:
    name, columns, args, what = refused[0]
    others = f"; and {_examples([r[0] for r in refused[1:]])}" if len(refused) > 1 else ""
    logger.warning(
        "%s: groups of %d do not divide the input features of %d module(s), and no group vLLM takes does: %s (%d input features, "
        "%s)%s. llmpress writes them with a shorter last group and reads them back, but vLLM and compressed-tensors refuse such "
        "a file. To deploy it there, add them to ignore (e.g. 're:.*%s$')%s",
        modifier, args.group_size, len(refused), name, columns, what, others, re.escape(name.rpartition(".")[2]),
        "" if args.is_float else f", or choose a group_size that divides {columns}, or strategy: channel",
    )


def _examples(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")
