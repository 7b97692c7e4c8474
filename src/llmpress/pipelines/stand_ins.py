"""Running a model with some of its modules answered by the pipeline instead.

``stood_in(root, answers)`` puts a ``StandIn`` in each given module's place in its parent (plain
``setattr``, as ``nn.ModuleList.__setitem__`` does) and puts the module back afterwards. The
model's code calls the stand-in as it would call the module; the stand-in returns whatever its
answer function gives: the module's output kept from an earlier run, a block's stored output,
zeros of the right shape where the value is never used. The module itself is untouched and can
still be called from the answer (``answer = lambda *a, **k: module(*a, **k)`` runs it, hooks
and all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["StandIn", "ZeroAnswer", "stood_in"]

Answer = Callable[..., Any]


class StandIn(nn.Module):
    """Takes ``replaced``'s place for a while. Attribute lookups the model's code makes on it
    (``attention_type``, ``weight.dtype``, ...) fall through to ``replaced``, which is not
    registered as a submodule of the stand-in."""

    def __init__(self, replaced: nn.Module, answer: Answer) -> None:
        super().__init__()
        object.__setattr__(self, "replaced", replaced)
        object.__setattr__(self, "answer", answer)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "replaced"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.answer(*args, **kwargs)


@contextmanager
def stood_in(root: nn.Module, answers: dict[nn.Module, Answer]) -> Iterator[None]:
    """Inside, every module of ``answers`` found under ``root`` is a ``StandIn`` giving
    ``answers[module](*args, **kwargs)``."""
    places = [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()
              if child in answers]
    try:
        for parent, name, child in places:
            setattr(parent, name, StandIn(child, answers[child]))
        yield
    finally:
        for parent, name, child in places:
            setattr(parent, name, child)


class ZeroAnswer:
    """Zeros shaped like a module's output, for a module whose output is never used: the input's
    leading dimensions and ``features`` columns, alone or first in a tuple of ``length`` with
    Nones after. One tensor per shape serves every call (its values never matter)."""

    def __init__(self, features: int, length: int | None, dtype: torch.dtype) -> None:
        self.features, self.length, self.dtype = features, length, dtype
        self._made: dict[tuple, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> Any:
        key = (tuple(x.shape[:-1]), x.device)
        zeros = self._made.get(key)
        if zeros is None:
            zeros = self._made[key] = torch.zeros(*x.shape[:-1], self.features, dtype=self.dtype, device=x.device)
        return zeros if self.length is None else (zeros, *([None] * (self.length - 1)))
