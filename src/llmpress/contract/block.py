"""The block protocol: what the calibration pipeline hands a modifier, and what a modifier may
ask of a block, without importing the pipeline.

``CalibrationBlock`` is what the pipeline hands to the modifiers with ``block_start``,
``modules_calibrated`` and ``layer_calibrated``: the block, its inputs for every calibration
batch (as the compressed blocks before it give them), and a way to re-run any of its submodules
on those inputs without the modifiers observing it again (``inputs_to`` / ``run``: AWQ's grid
search, SmoothQuant's ranges). The inputs are the block's own until the handlers return;
afterwards the pipeline makes each the block's output, for the next block.

The helpers read a block's output (``hidden_of``, ``rest_of``, ``with_rest``), find a model's
repeated blocks (``find_blocks``), say when two blocks are alike (``structure_of``) and count a
batch's tokens (``tokens_per_batch``): the pipeline and the algorithms read blocks the same way.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.contract.observation import Observation, primary_input
from llmpress.errors import UnsupportedModelError

__all__ = ["BlockArguments", "CalibrationBlock", "Inputs", "find_blocks", "hidden_of", "rest_of", "rows_of", "structure_of",
           "tokens_per_batch", "with_rest"]

#: one ``(args, kwargs)`` per calibration batch
Inputs = list[tuple[tuple, dict]]


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's repeated blocks: the ModuleList of same-class modules holding the most
    parameters (decoder layers, encoder layers, ``transformer.h``...), or None."""
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def structure_of(block: nn.Module) -> tuple:
    """What makes two blocks the same for anything decided by running one of them: every
    submodule's name and class and its own parameters' names and shapes (a model's repeated
    layers have one structure; a dense layer before MoE ones, or a sliding-window one, differs)."""
    return tuple((name, type(m).__name__, tuple((k, tuple(p.shape)) for k, p in m.named_parameters(recurse=False)))
                 for name, m in block.named_modules())


@dataclass
class CalibrationBlock:
    """One block being calibrated (see the module docstring)."""

    index: int
    module: nn.Module
    inputs: Inputs
    observation: Observation | None = None
    spill: Path | None = None  # where the module-by-module stages keep what they keep (kept.py), or in memory
    #: one run observes every target of the block at once (two passes), its modules_calibrated
    #: then names them all: a transform may read its statistics in that run (``scale_inputs``)
    observed_at_once: bool = False

    @torch.no_grad()
    def inputs_to(self, submodule: nn.Module) -> Inputs:
        """The ``(args, kwargs)`` ``submodule`` gets in each batch: the block runs once more,
        with nothing observed."""
        seen: Inputs = []
        handle = submodule.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
        try:
            with self.unobserved():
                for args, kwargs in self.inputs:
                    self.module(*args, **kwargs)
        finally:
            handle.remove()
        if len(seen) != len(self.inputs):
            raise UnsupportedModelError(
                f"{type(submodule).__name__} is not called once per forward of block {self.index}",
                got=f"{len(seen)} calls in {len(self.inputs)} batches",
                expected="a submodule the block calls exactly once",
            )
        return seen

    @torch.no_grad()
    def run(self, submodule: nn.Module, inputs: Inputs | None = None) -> list[Any]:
        """``submodule``'s output for each of ``inputs`` (default: ``inputs_to(submodule)``),
        with nothing observed."""
        inputs = self.inputs_to(submodule) if inputs is None else inputs
        with self.unobserved():
            return [submodule(*args, **kwargs) for args, kwargs in inputs]

    def unobserved(self) -> AbstractContextManager[None]:
        """Runs of the block (or its modules) inside it are not observed: a modifier's own
        forwards (AWQ's search, AutoRound's tuning)."""
        return self.observation.paused() if self.observation is not None else nullcontext()


def hidden_of(output: Any) -> Any:
    """A block's (or one of its modules') hidden states: its output, or the first of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def rest_of(output: Any) -> tuple | None:
    """What a block returns besides its hidden states (None when it returns them alone)."""
    return tuple(output[1:]) if isinstance(output, (tuple, list)) else None


def with_rest(hidden: torch.Tensor, rest: tuple | None) -> Any:
    """A block's output as the block gives it: the hidden states alone, or first in a tuple."""
    return hidden if rest is None else (hidden, *rest)


def rows_of(hidden: Any) -> int:
    """Tokens in a batch's hidden states: their leading dimensions (-1 when not a tensor)."""
    return hidden.shape[:-1].numel() if isinstance(hidden, torch.Tensor) and hidden.dim() > 0 else -1


def tokens_per_batch(inputs: Inputs) -> list[int]:
    """Tokens in each batch: the leading dimensions of the block's hidden states (-1: none)."""
    if hasattr(inputs, "token_rows"):  # spilled or on a device: without reading every batch back
        return inputs.token_rows()
    return [rows_of(primary_input(args, kwargs)) for args, kwargs in inputs]


#: distinct tensors ``BlockArguments`` compares a new one with at each place (Gemma 3: two kinds of layer)
_KEPT_PER_PLACE = 4


class BlockArguments:
    """What each block is called with besides its hidden states, where some block's differs from
    the first block's: Gemma 3's global layers take their own rotary tables and mask, gpt-oss's
    and Gemma 2's sliding layers their window's mask. Per block, per batch, its keyword arguments
    (equal tensors kept once, as ``share_repeated`` does), none for a block called with the first
    block's very objects. ``adopt`` makes a block's inputs carry its own."""

    def __init__(self, blocks: int) -> None:
        self.of_block: list[list[dict[str, Any]]] = [[] for _ in range(blocks)]
        self.differs = [False] * blocks
        self._seen: dict[tuple, list[torch.Tensor]] = {}  # the last distinct tensors kept at each place
        self._first_raw: dict[str, Any] = {}  # the first block's, in the batch being captured
        self.holding: int | None = 0  # whose arguments the inputs carry (None: not known)

    def note(self, index: int, kwargs: dict[str, Any], hidden: Any) -> None:
        """Block ``index``'s keyword arguments in the batch being captured (blocks in order). A
        block given the first block's very objects costs an identity test: nothing is kept or
        compared by value for it (the first block's are the inputs' own objects until ``kept``)."""
        own = {k: v for k, v in kwargs.items() if v is not hidden}
        if index == 0:
            self._first_raw = own
            self.of_block[0].append(own)
            return
        first = self._first_raw
        if not self.differs[index]:
            if own.keys() == first.keys() and all(_same(v, first[k]) for k, v in own.items()):
                return
            self.differs[index] = True  # the batches before gave it the first block's
            self.of_block[index] = list(self.of_block[0][:-1])
        self.of_block[index].append({k: self._once((k,), v) for k, v in own.items()})

    def _once(self, path: tuple, value: Any) -> Any:
        """``value`` with each tensor replaced by an equal one kept already at its place (one of
        the last few: the batches' rotary tables, a layer kind's mask), so each is held once."""
        if type(value) is tuple:
            return tuple(self._once((*path, i), item) for i, item in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value
        seen = self._seen.setdefault(path, [])
        for kept in seen:
            if kept is value or (kept.shape == value.shape and kept.dtype == value.dtype and kept.device == value.device
                                 and torch.equal(kept, value)):
                return kept
        seen.append(value)
        del seen[:-_KEPT_PER_PLACE]
        return value

    def kept(self) -> BlockArguments | None:
        """Self where a block's arguments differ from the first's, else None; the arguments of
        blocks called with the first block's are let go."""
        if not any(self.differs):
            self.of_block = []
            return None
        self.of_block = [[{k: self._once((k,), v) for k, v in kwargs.items()} for kwargs in own] if self.differs[i] or i == 0 else []
                         for i, own in enumerate(self.of_block)]
        self._seen, self._first_raw = {}, {}
        return self

    def adopt(self, inputs: Inputs, index: int) -> None:
        """Each batch of ``inputs`` (a block's, its hidden states as they are) takes block
        ``index``'s keyword arguments."""
        wanted = index if self.differs[index] else 0
        if wanted == self.holding:
            return
        items = getattr(inputs, "skeletons", inputs)  # spilled: the hidden states stay where they are
        for batch, (args, kwargs) in enumerate(items):
            hidden = primary_input(args, kwargs)
            items[batch] = (args, {**{k: v for k, v in kwargs.items() if v is hidden}, **self.of_block[wanted][batch]})
        self.holding = wanted


def _same(a: Any, b: Any) -> bool:
    """The very same object, or tuples of the very same objects."""
    return a is b or (type(a) is tuple and type(b) is tuple and len(a) == len(b) and all(x is y for x, y in zip(a, b)))

