"""One recorded forward of a block, for its plan (``plan.py``).

``Probe`` hooks every submodule of the block for one forward and records the calls, the order
they were entered in, each target's input and each submodule's output. With ``trace`` it also
learns who feeds whom: every floating-point output (and the block's own inputs) is handed on as a
fresh autograd leaf, and each output's and target input's graph is walked back to the leaves it
reached. The graph is built for its edges only (nothing is saved for a backward). Anything that
hides an edge from autograd (a module computing under ``no_grad``, an in-place change of an
output) leaves the probe ``untraced`` (with the reason), and the block is probed again untraced.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from llmpress.contract.observation import primary_input

__all__ = ["Probe"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class Probe:
    """Recording hooks on every submodule of a block for one forward: calls, entry order, the
    targets' inputs (to group them) and every output (to plan answers and zeros). With
    ``trace``, every floating-point output is handed on as a fresh autograd leaf, and each
    output's and target input's graph is walked back to the leaves it came from: who feeds whom."""

    def __init__(self, block: nn.Module, targets: set[nn.Module], trace: bool = False) -> None:
        self.block, self.targets, self.trace = block, targets, trace
        self.calls: Counter[nn.Module] = Counter()
        self.order: list[nn.Module] = []
        self.inputs: dict[nn.Module, Any] = {}
        self.outputs: dict[nn.Module, Any] = {}  # as the module's caller got it
        self.produced: dict[nn.Module, Any] = {}  # as the module's forward returned it
        self.target_inputs: list[tuple[nn.Module, Any]] = []
        self.unchanged: list[bool] = []  # per target call: its input equals what the previous one saw
        self._last: tuple[Any, torch.Tensor | None] = (None, None)
        self._owner: dict[int, nn.Module] = {}  # id of a leaf -> the module whose output it is
        self._sources: dict[nn.Module, set[nn.Module]] = {}  # module -> modules its output is computed from
        self._input_sources: dict[nn.Module, set[nn.Module]] = {}  # target -> modules its input is computed from
        self._untraced: list[str] = []
        self._kept_alive: list[torch.Tensor] = []

    def __enter__(self) -> Probe:
        inner = [m for m in self.block.modules() if m is not self.block]
        self.handles = [m.register_forward_pre_hook(self._before, with_kwargs=True) for m in inner]
        self.handles += [m.register_forward_hook(self._after) for m in inner]
        self._tracing = ExitStack()
        if self.trace:  # a graph for its edges only: nothing saved for a backward that never comes
            self._tracing.enter_context(torch.enable_grad())
            self._tracing.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda t: None))
            self._tracing.enter_context(warnings.catch_warnings())  # the model's "requires_grad" warnings:
            warnings.simplefilter("ignore", UserWarning)  # this run only
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        self._tracing.close()
        for handle in self.handles:
            handle.remove()
        if self.trace and isinstance(exc, RuntimeError):  # e.g. an in-place change of a leaf
            self._untraced.append(str(exc).splitlines()[0])
            return True  # the forward is given up: the block is probed again, untraced
        return False

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls[module] += 1
        self.order.append(module)
        x = primary_input(args, kwargs)
        self.inputs.setdefault(module, x)
        if module in self.targets:
            self.target_inputs.append((module, x))
            if self.trace:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
                    self._untraced.append(f"{type(module).__name__}'s input has no graph")
                self._input_sources.setdefault(module, self._walk(x))
            else:  # call order groups by an input seen again unchanged: a snapshot to compare with
                previous, snapshot = self._last
                self.unchanged.append(x is previous and snapshot is not None and torch.equal(x, snapshot))
                self._last = (x, x.detach().clone() if isinstance(x, torch.Tensor) else None)

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.produced.setdefault(module, output)
        if self.trace:
            if any(t.is_floating_point() and not t.requires_grad for t in _tensors(output)):
                self._untraced.append(f"{type(module).__name__}'s output has no graph")
            self._sources.setdefault(module, self._walk(output))
            output = self.leaves(module, output)
        self.outputs.setdefault(module, output)
        return output if self.trace else None

    # -- tracing -------------------------------------------------------------------------------
    def leaves(self, module: nn.Module | None, output: Any) -> Any:
        """``output`` with its floating-point tensors as new leaves owned by ``module`` (None:
        the block's inputs)."""
        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return t
            fresh = t.detach().requires_grad_(True)
            if module is not None:
                self._owner[id(fresh)] = module
            self._kept_alive.append(fresh)  # ids stay unique while the probe runs
            return fresh
        if isinstance(output, torch.Tensor):
            return leaf(output)
        if type(output) is tuple:
            return tuple(leaf(t) for t in output)
        return output

    def _walk(self, value: Any) -> set[nn.Module]:
        """The modules whose leaves ``value``'s graph reaches, directly."""
        found: set[nn.Module] = set()
        stack: list[Any] = []
        for t in _tensors(value):
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif id(t) in self._owner:
                found.add(self._owner[id(t)])
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for following, _ in node.next_functions:
                if following is None:
                    continue
                variable = getattr(following, "variable", None)
                if variable is not None:
                    if id(variable) in self._owner:
                        found.add(self._owner[id(variable)])
                else:
                    stack.append(following)
        return found

    def sources(self) -> dict[nn.Module, set[nn.Module]]:
        """Each submodule's output: the submodules whose outputs it is computed from, directly."""
        return {m: set(found) for m, found in self._sources.items()}

    def input_sources(self) -> dict[nn.Module, set[nn.Module]]:
        """Each target's input: the submodules whose outputs it is computed from, directly."""
        return {m: set(found) for m, found in self._input_sources.items()}

    def sources_of(self, value: Any) -> set[nn.Module]:
        """The submodules whose outputs ``value`` (the block's output) is computed from, directly."""
        return self._walk(value)

    @property
    def untraced(self) -> str | None:
        """Why the traced forward cannot be trusted, or None."""
        return self._untraced[0] if self.trace and self._untraced else None

    def needs(self) -> dict[nn.Module, set[nn.Module]] | None:
        """Each target's upstream: every submodule its input was computed from, transitively."""
        if not self.trace:
            return None
        closure: dict[nn.Module, set[nn.Module]] = {}
        # a method, not a nested function that calls itself: such a function is a reference
        # cycle, and it held the probe (a batch of every submodule's output: 40 MB a layer on a
        # 2048-wide Llama) until the garbage collector happened to run
        upstream = functools.partial(self._upstream, closure=closure)
        needs = {}
        for target, sources in self._input_sources.items():
            needs[target] = set(sources).union(*(upstream(s) for s in sources)) if sources else set()
        return needs

    def _upstream(self, module: nn.Module, closure: dict[nn.Module, set[nn.Module]]) -> set[nn.Module]:
        if module not in closure:
            closure[module] = set()  # a module never feeds itself
            found = set()
            for source in self._sources.get(module, ()):
                found |= {source} | self._upstream(source, closure)
            closure[module] = found
        return closure[module]

    def groups(self, needs: dict[nn.Module, set[nn.Module]] | None) -> list[list[nn.Module]]:
        """Traced (``needs`` given): targets by depth (see the module's docstring), in call order
        within one. Else in call order; one that reads its predecessor's input, unchanged, joins
        its group."""
        if needs is not None:
            depth: dict[nn.Module, int] = {}
            for module, _ in self.target_inputs:
                depth[module] = 1 + max((depth[t] for t in needs[module] if t in depth), default=-1)
            return [[m for m, _ in self.target_inputs if depth[m] == d] for d in sorted(set(depth.values()))]
        groups: list[list[nn.Module]] = []
        for (module, _), same in zip(self.target_inputs, self.unchanged):
            if groups and same:
                groups[-1].append(module)
            else:
                groups.append([module])
        return groups

    def zero_shape(self, module: nn.Module) -> tuple[int, int | None, torch.dtype] | None:
        """``(features, tuple length or None, dtype)`` when the output can be made from the input's shape."""
        x, output = self.inputs.get(module), self.outputs.get(module)
        length = None
        if isinstance(output, tuple) and output and all(o is None for o in output[1:]):
            output, length = output[0], len(output)
        if not (isinstance(x, torch.Tensor) and isinstance(output, torch.Tensor)) or x.dim() == 0 or output.dim() == 0:
            return None
        if output.shape[:-1] != x.shape[:-1]:
            return None
        return output.shape[-1], length, output.dtype
