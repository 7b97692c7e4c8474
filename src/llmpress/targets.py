"""Which modules a recipe entry points at.

A target or ignore entry is a class name (``Linear``, matched against the module's class and its
bases), an exact module name (``model.layers.0.mlp.down_proj``), or a regular expression prefixed
with ``re:`` matched against the module name (``re:.*q_proj$``) — the grammar of llm-compressor
and compressed-tensors, so their recipes and configs mean the same thing here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import nn

__all__ = ["matches", "match_modules"]


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def matches(name: str, module: nn.Module, patterns: Iterable[str]) -> bool:
    classes = None
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name:
            return True
        else:
            classes = classes if classes is not None else _class_names(module)
            if pattern in classes:
                return True
    return False


def match_modules(
    model: nn.Module, targets: Iterable[str], ignore: Iterable[str] = ()
) -> Iterator[tuple[str, nn.Module]]:
    """Modules of ``model`` matched by ``targets`` and not by ``ignore``, in model order."""
    targets, ignore = list(targets), list(ignore)
    for name, module in model.named_modules():
        if name and matches(name, module, targets) and not matches(name, module, ignore):
            yield name, module
