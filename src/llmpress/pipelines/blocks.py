"""A model's repeated blocks, the inputs cached for them, and what a modifier may ask of a block.

``CalibrationBlock`` is what the pipeline hands to the modifiers with ``modules_calibrated`` and
``layer_calibrated``: the block, its inputs for every calibration batch (as the compressed blocks
before it give them), and a way to re-run any of its submodules on those inputs without the
modifiers observing it again (``inputs_to`` / ``run``: AWQ's grid search, SmoothQuant's ranges).
The inputs are the block's own until the handlers return; afterwards each becomes the block's
output, for the next block (``hand_on``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.observation import Observation, primary_input, with_primary_input
from llmpress.pipelines.kept import SpilledInputs
from llmpress.pipelines.stand_ins import stood_in

__all__ = ["CalibrationBlock", "Inputs", "capture_block_inputs", "find_blocks", "hand_on", "hidden_of", "rest_of", "share_repeated",
           "structure_of", "with_rest"]

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
            with self._unobserved():
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
        with self._unobserved():
            return [submodule(*args, **kwargs) for args, kwargs in inputs]

    def _unobserved(self) -> AbstractContextManager[None]:
        return self.observation.paused() if self.observation is not None else nullcontext()


def hidden_of(output: Any) -> Any:
    """A block's (or one of its modules') hidden states: its output, or the first of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def hand_on(inputs: Inputs, index: int, output: Any) -> tuple | None:
    """Batch ``index``'s input becomes the block's ``output`` (its hidden states, the other
    arguments as they were), for the next block. Returns ``rest_of(output)``."""
    skeletons = getattr(inputs, "skeletons", None)  # spilled or on a device: without reading the hidden states back
    current = skeletons[index] if skeletons is not None else inputs[index]
    inputs[index] = with_primary_input(*current, hidden_of(output))
    return rest_of(output)


def rest_of(output: Any) -> tuple | None:
    """What a block returns besides its hidden states (None when it returns them alone)."""
    return tuple(output[1:]) if isinstance(output, (tuple, list)) else None


def with_rest(hidden: torch.Tensor, rest: tuple | None) -> Any:
    """A block's output as the block gives it: the hidden states alone, or first in a tuple."""
    return hidden if rest is None else (hidden, *rest)


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, batches: list[torch.Tensor], device: torch.device,
                         observation: Observation, spill: Path | None = None) -> tuple[Inputs, set[nn.Module]]:
    """Each batch's ``(args, kwargs)`` into the first block, and the watched modules that ran
    before it (observed on the way; nothing after the first block is observed).

    The model's base runs with every block stood in: the first records its inputs (the hidden
    states copied, so nothing the model does after it can change them) and answers with them (for
    the first batch it runs the real block once, unobserved, to answer in the block's own output
    form), the others pass them on. With ``spill``, the hidden states go to a file there
    (``SpilledInputs``) and come back one batch at a time."""
    inputs: Inputs = [] if spill is None else SpilledInputs([batch.numel() for batch in batches], spill)
    form: list[tuple | None] = []  # what a block returns besides its hidden states
    inside = set(blocks.modules())
    outside = [m for m in observation.targets if m not in inside]
    reached: set[nn.Module] = set()  # watched modules run before the first block: observed
    in_blocks = False
    real_first = blocks[0]  # inside, blocks[0] is its stand-in

    def first(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_blocks
        in_blocks = True
        hidden = primary_input(args, kwargs)
        inputs.append(with_primary_input(args, kwargs, hidden.clone()))
        if not form:
            with observation.paused():
                form.append(rest_of(real_first(*args, **kwargs)))
        return with_rest(hidden, form[0])

    def later(*args: Any, **kwargs: Any) -> Any:
        return with_rest(primary_input(args, kwargs), form[0])

    def note(module: nn.Module, args: tuple) -> None:  # runs before the observation hook
        if not in_blocks:
            reached.add(module)

    handles = [m.register_forward_pre_hook(note, prepend=True) for m in outside]
    answers = {block: (first if i == 0 else later) for i, block in enumerate(blocks)}
    try:
        with stood_in(model, answers), observation.only(reached):
            for batch in batches:
                in_blocks = False
                _base_model(model)(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, reached


def _base_model(model: nn.Module) -> nn.Module:
    """The model without its head (``model.model``, ``bert``...) when it has one, else itself:
    what comes after the blocks is not needed to reach them."""
    base = getattr(model, "base_model", model)
    return base if isinstance(base, nn.Module) else model


def share_repeated(inputs: Inputs) -> None:
    """Keyword inputs equal to the first batch's (rotary tables, attention masks: the same for
    every batch of unpadded samples of one length) become that batch's tensor, kept once instead
    of once per batch: for a Llama with head_dim 128 on 2048-token samples, 2 MB a batch of
    rotary tables; a materialised eager-attention mask is 16 MB a batch. The hidden states are
    never shared: each batch's are replaced by the block's output."""
    first: dict[tuple, torch.Tensor] = {}

    def share(path: tuple, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            seen = first.setdefault(path, value)
            same = (seen is not value and seen.shape == value.shape and seen.dtype == value.dtype
                    and seen.device == value.device and torch.equal(seen, value))
            return seen if same else value
        if type(value) is tuple:
            return tuple(share((*path, i), item) for i, item in enumerate(value))
        return value

    items = inputs.skeletons if isinstance(inputs, SpilledInputs) else inputs  # the spilled hidden states stay where they are
    for index, (args, kwargs) in enumerate(items):
        items[index] = (args, {k: v if k == "hidden_states" else share((k,), v) for k, v in kwargs.items()})
