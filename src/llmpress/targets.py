"""Which modules a recipe entry points at.

A target or ignore entry is a class name (``Linear``, matched against the module's class and its
bases), an exact module name (``model.layers.0.mlp.down_proj``), or a regular expression prefixed
with ``re:`` matched against the module name (``re:.*q_proj$``) — the grammar of llm-compressor
and compressed-tensors, so their recipes and configs mean the same thing here. When several
entries match one module, the most specific wins as in compressed-tensors: an exact name, then a
regular expression, then a class name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

__all__ = ["matches", "match_priority", "assign_by_targets"]

EXACT, REGEX, CLASS = 0, 1, 2


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def match_priority(name: str, module: nn.Module, patterns: Iterable[str]) -> int | None:
    """How specifically ``patterns`` match the module (``EXACT`` < ``REGEX`` < ``CLASS``), or None."""
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
        if found is not None and (best is None or found < best):
            best = found
    return best


def matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    return match_priority(name, module, patterns) is not None


def assign_by_targets(
    model: nn.Module, entries: list[tuple[list[str], object]], ignore: Iterable[str] = ()
) -> dict[str, tuple[nn.Module, object]]:
    """For each module matched by some entry's targets (and not ignored), the entry's value that
    matches it most specifically; among equally specific entries the first wins."""
    ignore = list(ignore)
    chosen: dict[str, tuple[nn.Module, object]] = {}
    for name, module in model.named_modules():
        if not name or matches(name, module, ignore):
            continue
        best = None
        for targets, value in entries:
            priority = match_priority(name, module, targets)
            if priority is not None and (best is None or priority < best[0]):
                best = (priority, value)
        if best is not None:
            chosen[name] = (module, best[1])
    return chosen
