"""Which modules a recipe entry points at.

A target or ignore entry is a class name (``Linear``, matched against the module's class and its
bases), an exact module name (``model.layers.0.mlp.down_proj``), or a regular expression prefixed
with ``re:`` matched against the module name (``re:.*q_proj$``) — the grammar of llm-compressor
and compressed-tensors, so their recipes and configs mean the same thing here. When several
entries match one module, the most specific wins as in compressed-tensors: an exact name, then a
regular expression, then a class name.

Recipes match with ``linear_alias``: their ``Linear`` also names transformers' ``Conv1D``, the
transposed linear of GPT-2 (see ``llmpress.models.linear``), and does not name an MoE block's
router (``ROUTER_NAMES``: most are not Linear in transformers 5; Phi-MoE's is a Linear subclass
that reads its own ``weight``, and a quantized one loads nowhere); a name or pattern still does.
A checkpoint's config is matched without it, as compressed-tensors matches it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from llmpress.models.linear import input_major

__all__ = ["ROUTER_NAMES", "matches", "match_priority", "assign_by_targets", "moe_routers", "name_conv1d_targets"]

EXACT, REGEX, CLASS, ALIAS = 0, 1, 2, 3  # ALIAS: a recipe's Linear naming a Conv1D, below its own class name

#: the names of an MoE block's router beside its ``experts``
ROUTER_NAMES = ("gate", "router")


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def match_priority(name: str, module: nn.Module, patterns: Iterable[str], linear_alias: bool = False) -> int | None:
    """How specifically ``patterns`` match the module (``EXACT`` < ``REGEX`` < ``CLASS`` < ``ALIAS``), or None."""
    best = None
    classes = None
    for pattern in patterns:
        if pattern.startswith("re:"):
            found = REGEX if re.match(pattern[3:], name) else None
        elif pattern == name:
            found = EXACT
        else:
            classes = classes if classes is not None else _class_names(module)
            found = CLASS if pattern in classes else None
            if found is None and linear_alias and pattern == "Linear" and input_major(module):
                found = ALIAS
        if found is not None and (best is None or found < best):
            best = found
    return best


def matches(name: str, module: nn.Module, patterns: Iterable[str], linear_alias: bool = False) -> bool:
    return match_priority(name, module, patterns, linear_alias) is not None


def moe_routers(model: nn.Module) -> set[str]:
    """The names a router of ``model``'s MoE blocks would have (``ROUTER_NAMES`` beside ``experts``)."""
    return {f"{n}.{leaf}" if n else leaf for n, m in model.named_modules() if hasattr(m, "experts") for leaf in ROUTER_NAMES}


def assign_by_targets(
    model: nn.Module, entries: list[tuple[list[str], object]], ignore: Iterable[str] = (), linear_alias: bool = False,
) -> dict[str, tuple[nn.Module, object]]:
    """For each module matched by some entry's targets (and not ignored), the entry's value that
    matches it most specifically; among equally specific entries the first wins. With
    ``linear_alias`` (a recipe's targets), ``Linear`` does not reach an MoE router."""
    ignore = list(ignore)
    routers = moe_routers(model) if linear_alias else set()
    chosen: dict[str, tuple[nn.Module, object]] = {}
    for name, module in model.named_modules():
        if not name or matches(name, module, ignore, linear_alias):
            continue
        best = None
        for targets, value in entries:
            if name in routers:
                targets = [t for t in targets if t != "Linear"]
            priority = match_priority(name, module, targets, linear_alias)
            if priority is not None and (best is None or priority < best[0]):
                best = (priority, value)
        if best is not None:
            chosen[name] = (module, best[1])
    return chosen


def name_conv1d_targets(chosen: dict[str, tuple[nn.Module, Any]]) -> dict[str, tuple[nn.Module, Any]]:
    """Each Conv1D that only the ``Linear`` alias matched gets its scheme with ``Conv1D`` among
    the targets (one copy per scheme), so a saved config names it as compressed-tensors matches.
    Changes ``chosen`` in place and returns it."""
    copies: dict[int, Any] = {}
    for name, (module, scheme) in chosen.items():
        if input_major(module) and not matches(name, module, scheme.targets):
            if id(scheme) not in copies:
                copies[id(scheme)] = scheme.model_copy(update={"targets": [*scheme.targets, "Conv1D"]})
            chosen[name] = (module, copies[id(scheme)])
    return chosen
