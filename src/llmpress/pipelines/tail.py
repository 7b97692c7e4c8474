"""Calibrating what comes after the repeated blocks (a final norm's projection, an lm_head the
recipe quantizes, an encoder's head) without running the blocks again.

The model runs once more per batch with every block swapped for a stand-in that computes
nothing; the last stand-in hands over the stored output of the real last block, so the modules
after it see exactly the inputs the compressed model gives them. A guard placed before the
modifiers' hooks checks that the output really was handed over for this batch (a model that
skips or repeats its last block is refused before any statistic is taken), and once every
watched module has seen its input the batch stops: the logits are never computed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TailError", "run_tail", "watched_tail"]


class TailError(RuntimeError):
    """The model could not run around stand-ins; no statistic was taken."""


class _TailSeen(Exception):
    """Every watched module after the blocks has seen this batch's input."""


class _StandIn(nn.Module):
    """Takes a block's place: computes nothing, and answers attribute lookups the model's code
    makes on its blocks (``attention_type``, say) from the block it replaces."""

    def __init__(self, block: nn.Module, give) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)  # not registered as a submodule
        self.give = give

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.give(args[0] if args else kwargs.get("hidden_states"))


def hook_keys(model: nn.Module) -> dict[int, set[int]]:
    """The forward pre-hooks each module has now, to tell later (the modifiers') hooks apart."""
    return {id(m): set(m._forward_pre_hooks) for m in model.modules()}


def watched_tail(model: nn.Module, layers: nn.ModuleList, reached: set[int], before: dict[int, set[int]]) -> list[nn.Module]:
    """Modules outside the blocks that the run up to the first block did not reach and that
    got a forward pre-hook since ``before`` (a modifier watching them)."""
    inside = {id(m) for m in layers.modules()}
    return [
        m for m in model.modules()
        if id(m) not in inside and id(m) not in reached and set(m._forward_pre_hooks) - before.get(id(m), set())
    ]


def run_tail(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor], outputs: list[torch.Tensor],
             rest: tuple | None, tail: list[nn.Module], device: torch.device) -> None:
    """Run ``batches`` through the model with stand-ins for ``layers``; ``outputs[i]`` is the
    last block's output for batch ``i``, ``rest`` what the block returns besides it (taken from
    one call: flags and Nones, the same for every batch). Raises ``TailError`` when the model
    cannot run this way before any statistic was taken; other errors propagate."""
    wrap = (lambda hidden: hidden) if rest is None else (lambda hidden: (hidden, *rest))
    handed = [0]
    current = [0]
    seen: set[int] = set()
    taken = [False]

    def hand_over(_: Any) -> Any:
        if handed[0] != current[0]:
            raise TailError("the model ran its last block more than once for one batch")
        handed[0] += 1
        return wrap(outputs[current[0]])

    def guard(module: nn.Module, args: tuple) -> None:  # before the modifiers' hooks
        if handed[0] != current[0] + 1:
            raise TailError(f"{type(module).__name__} ran before the last block's output was handed over")

    def stop_when_seen(module: nn.Module, args: tuple) -> None:  # after them
        taken[0] = True
        seen.add(id(module))
        if len(seen) == len(tail):
            raise _TailSeen

    originals = list(layers)
    handles = [m.register_forward_pre_hook(guard, prepend=True) for m in tail]
    handles += [m.register_forward_pre_hook(stop_when_seen) for m in tail]
    try:
        for index, block in enumerate(originals):
            layers[index] = _StandIn(block, hand_over if index == len(originals) - 1 else wrap)
        for index, batch in enumerate(batches):
            current[0] = index
            seen.clear()
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except _TailSeen:
                pass
    except TailError:
        raise
    except Exception as exc:
        if taken[0]:
            raise
        raise TailError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
        for index, block in enumerate(originals):
            layers[index] = block
