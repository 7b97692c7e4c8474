"""Where the layerwise pipeline gets a block's inputs, and how it hands a block's outputs on.

``capture_block_inputs`` runs the model's base once per batch with every block stood in, and
keeps what reaches the first block; ``share_repeated`` keeps arguments every batch shares once;
``hand_on`` makes a batch's input the block's output, for the next block. What a block is to
the modifiers is in ``llmpress.contract.block``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.contract.block import BlockArguments, Inputs, hidden_of, rest_of, with_rest
from llmpress.contract.observation import Observation, primary_input, with_primary_input
from llmpress.pipelines.stand_ins import stood_in
from llmpress.pipelines.storage.kept import SpilledInputs

__all__ = ["capture_block_inputs", "hand_on", "share_repeated"]


def hand_on(inputs: Inputs, index: int, output: Any) -> tuple | None:
    """Batch ``index``'s input becomes the block's ``output`` (its hidden states, the other
    arguments as they were), for the next block. Returns ``rest_of(output)``."""
    skeletons = getattr(inputs, "skeletons", None)  # spilled or on a device: without reading the hidden states back
    current = skeletons[index] if skeletons is not None else inputs[index]
    inputs[index] = with_primary_input(*current, hidden_of(output))
    return rest_of(output)


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, batches: list[torch.Tensor], device: torch.device,
                         observation: Observation, spill: Path | None = None
                         ) -> tuple[Inputs, set[nn.Module], BlockArguments | None]:
    """Each batch's ``(args, kwargs)`` into the first block, the watched modules that ran before
    it (observed on the way; nothing after the first block is observed), and what the other
    blocks get besides their hidden states where it is not what the first one gets
    (``BlockArguments``; None where every block gets the first one's).

    The model's base runs with every block stood in: the first records its inputs (the hidden
    states copied, so nothing the model does after it can change them) and answers with them (for
    the first batch it runs the real block once, unobserved, to answer in the block's own output
    form), the others note their keyword arguments and pass the hidden states on. With ``spill``,
    the hidden states go to a file there (``SpilledInputs``) and come back one batch at a time."""
    inputs: Inputs = [] if spill is None else SpilledInputs([batch.numel() for batch in batches], spill)
    form: list[tuple | None] = []  # what a block returns besides its hidden states
    inside = set(blocks.modules())
    outside = [m for m in observation.targets if m not in inside]
    reached: set[nn.Module] = set()  # watched modules run before the first block: observed
    in_blocks = False
    real_first = blocks[0]  # inside, blocks[0] is its stand-in

    arguments = BlockArguments(len(blocks))

    def first(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_blocks
        in_blocks = True
        hidden = primary_input(args, kwargs)
        inputs.append(with_primary_input(args, kwargs, hidden.clone()))
        arguments.note(0, kwargs, hidden)
        if not form:
            with observation.paused():
                form.append(rest_of(real_first(*args, **kwargs)))
        return with_rest(hidden, form[0])

    def later(index: int):
        def answer(*args: Any, **kwargs: Any) -> Any:
            hidden = primary_input(args, kwargs)
            arguments.note(index, kwargs, hidden)
            return with_rest(hidden, form[0])
        return answer

    def note(module: nn.Module, args: tuple) -> None:  # runs before the observation hook
        if not in_blocks:
            reached.add(module)

    handles = [m.register_forward_pre_hook(note, prepend=True) for m in outside]
    answers = {block: (first if i == 0 else later(i)) for i, block in enumerate(blocks)}
    try:
        with stood_in(model, answers), observation.only(reached):
            for batch in batches:
                in_blocks = False
                _base_model(model)(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, reached, arguments.kept()


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
    items = inputs.skeletons if isinstance(inputs, SpilledInputs) else inputs  # the spilled hidden states stay where they are
    for index, (args, kwargs) in enumerate(items):
        items[index] = (args, {k: v if k == "hidden_states" else _shared(first, (k,), v) for k, v in kwargs.items()})


def _shared(first: dict[tuple, torch.Tensor], path: tuple, value: Any) -> Any:
    """``value`` with its tensors replaced by the equal ones ``first`` holds at their paths
    (a module-level function: a nested one that calls itself is a reference cycle, and it kept
    the first batch's tensors until the garbage collector ran)."""
    if isinstance(value, torch.Tensor):
        seen = first.setdefault(path, value)
        same = (seen is not value and seen.shape == value.shape and seen.dtype == value.dtype
                and seen.device == value.device and torch.equal(seen, value))
        return seen if same else value
    if type(value) is tuple:
        return tuple(_shared(first, (*path, i), item) for i, item in enumerate(value))
    return value
