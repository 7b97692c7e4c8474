"""One small generic registry for modifiers, formats, quantizers and datasets.

Registration is explicit (``@REGISTRY.register("name")``); registering a name twice is an
error; an unknown name lists the known ones and suggests the closest. Out-of-tree plugins are
found through the entry-point group ``llmpress.<kind>`` the first time a lookup misses.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from llmpress.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, error: type[Exception] = RegistryError) -> None:
        self.kind = kind
        self._error = error
        self._items: dict[str, T] = {}
        self._plugins_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise RegistryError(
                    f"{self.kind} {name!r} is registered twice",
                    got=f"{item!r} after {self._items[name]!r}",
                    fix="give the new one another name",
                )
            self._items[name] = item
            return item

        return decorator

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a test's own registration, say); unknown names are an error."""
        if name not in self._items:
            raise RegistryError(f"{self.kind} {name!r} is not registered", expected=f"one of {', '.join(self.names())}")
        del self._items[name]

    def get(self, name: str) -> T:
        if name not in self._items and not self._plugins_loaded:
            self._load_plugins()
        if name not in self._items:
            raise self._error(
                f"unknown {self.kind} {name!r}",
                got=name,
                expected=f"one of {', '.join(sorted(self._items)) or '(none registered)'}",
                fix=self._suggestion(name),
            )
        return self._items[name]

    def _suggestion(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._items), n=1, cutoff=0.5)
        if close:
            return f"did you mean {close[0]!r}?"
        return f"use one of the known {self.kind} names"

    def _load_plugins(self) -> None:
        self._plugins_loaded = True
        for entry in entry_points(group=f"llmpress.{self.kind.replace(' ', '_')}"):
            entry.load()  # importing the plugin module runs its @register calls

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)
