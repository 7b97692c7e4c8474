"""Calibration inputs, handed from the model to the modifiers that asked for them.

Between ``calibration_start`` and ``calibration_end`` the session keeps one ``Observation``: a
forward pre-hook (a removable handle) on every module some modifier lists in
``calibration_targets()``, each handing the module's input to those modifiers' ``observe``. The
modifiers never hook the model themselves, so a pipeline can:

* run a stand-in in a module's place and still have its input observed (``feed``);
* re-run compressed modules without the modifiers seeing those inputs again (``paused``);
* let only some modules observe in a forward (``only``: one group of a block at a time).

A modifier may also watch a module for one block (``watch`` ... ``unwatch``): SmoothQuant gathers
its channel ranges in the block's observing run instead of a run of its own.

A run that needs only the inputs can stop each forward once they are all in (``until``): the
hook raises ``InputsSeen`` right after the last one, and what follows it in the block is not
computed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpress.errors import LlmpressError

if TYPE_CHECKING:
    from llmpress.contract.modifier import Modifier

__all__ = ["InputsSeen", "Observation", "primary_input", "with_primary_input"]


def _primary_key(args: tuple, kwargs: dict[str, Any]) -> int | str | None:
    if args:
        return 0
    if "hidden_states" in kwargs:
        return "hidden_states"
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)


def primary_input(args: tuple, kwargs: dict[str, Any]) -> Any:
    """What a module is called on: its first argument, else ``hidden_states``, else the first
    tensor among its keyword arguments (None when there is none)."""
    key = _primary_key(args, kwargs)
    if key is None:
        return None
    return args[0] if key == 0 else kwargs[key]


def with_primary_input(args: tuple, kwargs: dict[str, Any], value: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` with ``primary_input`` replaced by ``value``."""
    key = _primary_key(args, kwargs)
    if key == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, key or "hidden_states": value}


class InputsSeen(LlmpressError):
    """Every input a forward waits for is observed (``Observation.until``): raised by the hook,
    caught by whoever runs the forward, so the rest of it is not computed."""


class Observation:
    def __init__(self, modifiers: Iterable[Modifier]) -> None:
        self.modifiers = list(modifiers)  # in the session's order: the order their hooks run in
        self.watchers: dict[nn.Module, list[tuple[Modifier, str]]] = {}
        for modifier in self.modifiers:
            for name, module in modifier.calibration_targets().items():
                self.watchers.setdefault(module, []).append((modifier, name))
        self._only: set[nn.Module] | None = None
        self._paused = 0
        # first among the module's pre-hooks: the input as the module is called with it (before
        # an input quantization of an earlier stage), as a stand-in hands it over too
        self._handles = [self._hook_on(m) for m in self.watchers]
        self._added: dict[nn.Module, Any] = {}  # the hooks of modules only ``watch`` added
        self._temporary: list[tuple[nn.Module, Modifier, str]] = []
        self._fed: Counter | None = None  # inputs observed per module, inside ``until``
        self._enough: Counter | None = None

    def _hook_on(self, module: nn.Module) -> Any:
        handle = module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)
        # ...after a rotation of the input the module applies at run time (``runs_first``: QuIP,
        # SpinQuant's R4), so that what is observed is what the weights multiply
        hooks = module._forward_pre_hooks
        for key in [k for k, hook in hooks.items() if getattr(hook, "runs_first", False)]:
            hooks.move_to_end(key, last=False)
        return handle

    @property
    def targets(self) -> list[nn.Module]:
        """Every watched module."""
        return list(self.watchers)

    def watches(self, module: nn.Module) -> bool:
        return module in self.watchers

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._paused or (self._only is not None and module not in self._only):
            return
        self.feed(module, primary_input(args, kwargs))
        if self._fed is not None:
            self._fed[module] += 1
            if self._fed == self._enough:
                raise InputsSeen("every input this forward waits for is observed")

    def feed(self, module: nn.Module, x: torch.Tensor) -> None:
        """Hand ``x`` to the modifiers watching ``module`` as its input."""
        for modifier, name in self.watchers.get(module, ()):
            modifier.observe(name, x)

    def watch(self, module: nn.Module, modifier: Modifier, name: str) -> None:
        """``modifier.observe(name, x)`` gets ``module``'s inputs too, until ``unwatch``."""
        if module not in self.watchers:
            self._added[module] = self._hook_on(module)
        self.watchers.setdefault(module, []).append((modifier, name))
        self._temporary.append((module, modifier, name))

    def unwatch(self, modifier: Modifier) -> None:
        """End every ``watch`` of ``modifier``."""
        mine = [t for t in self._temporary if t[1] is modifier]
        self._temporary = [t for t in self._temporary if t[1] is not modifier]
        for module, _, name in mine:  # by identity: two modifiers may compare equal (same config)
            watching = self.watchers[module]
            del watching[next(i for i, (w, n) in enumerate(watching) if w is modifier and n == name)]
            if not watching:
                del self.watchers[module]
                self._added.pop(module).remove()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No module is observed inside."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def only(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Only ``modules`` are observed inside (the others run unobserved). A ``set`` is read as
        it is when each module runs, so a caller may add to it meanwhile."""
        previous, self._only = self._only, modules if isinstance(modules, set) else set(modules)
        try:
            yield
        finally:
            self._only = previous

    @contextmanager
    def until(self, enough: Counter | None) -> Iterator[Counter]:
        """Count the inputs observed inside, per module (the Counter yielded); once the count is
        ``enough`` (when given), the hook raises ``InputsSeen`` after handing that input over."""
        previous = self._fed, self._enough
        self._fed, self._enough = Counter(), enough
        try:
            yield self._fed
        finally:
            self._fed, self._enough = previous

    def remove(self) -> None:
        for handle in [*self._handles, *self._added.values()]:
            handle.remove()
        self._handles.clear()
        self._added.clear()
        self._temporary.clear()
        self.watchers.clear()
