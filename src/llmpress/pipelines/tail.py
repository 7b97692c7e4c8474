"""Calibrating what comes after the repeated blocks (a final norm's projection, an lm_head the
recipe quantizes, an encoder's head) without running the blocks again.

The model runs once more per batch with every block stood in by one that computes nothing; the
last one hands over the stored output of the real last block, so the modules after it see
exactly the inputs the compressed model gives them. A check placed before the observation hook
makes sure the output really was handed over for this batch: a model that skips or repeats its
last block is refused (``TailError``) before anything is observed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.contract.block import with_rest
from llmpress.contract.observation import Observation, primary_input
from llmpress.errors import UnsupportedModelError
from llmpress.pipelines.stand_ins import stood_in

__all__ = ["TailError", "run_tail"]


class TailError(UnsupportedModelError):
    """The model could not run around stand-ins; nothing was observed."""

    def __init__(self, what: str) -> None:
        super().__init__(what, expected="a model whose modules after its blocks run on the last block's output")


@torch.no_grad()
def run_tail(model: nn.Module, blocks: nn.ModuleList, batches: list[torch.Tensor], outputs: list[torch.Tensor],
             rest: tuple | None, tail: list[nn.Module], device: torch.device, observation: Observation) -> None:
    """Run ``batches`` through the model with stand-ins for ``blocks``, observing ``tail``;
    ``outputs[i]`` is the last block's output for batch ``i``, ``rest`` what the block returns
    besides it (the same for every batch). Raises ``TailError`` when the model cannot run this
    way and nothing was observed yet; once something was, any error propagates as it is."""
    handed = 0  # outputs handed over so far
    current = 0  # the batch in flight
    observed = False

    def hand_over(*args: Any, **kwargs: Any) -> Any:
        nonlocal handed
        if handed != current:
            raise UnsupportedModelError("the model ran its last block more than once for one batch")
        handed += 1
        return with_rest(outputs[current], rest)

    def pass_on(*args: Any, **kwargs: Any) -> Any:
        return with_rest(primary_input(args, kwargs), rest)

    def check(module: nn.Module, args: tuple) -> None:  # runs before the observation hook
        nonlocal observed
        if handed != current + 1:
            raise UnsupportedModelError(f"{type(module).__name__} ran before the last block's output was handed over")
        observed = True

    last = len(blocks) - 1
    answers = {block: hand_over if i == last else pass_on for i, block in enumerate(blocks)}
    handles = [m.register_forward_pre_hook(check, prepend=True) for m in tail]
    try:
        with stood_in(model, answers), observation.only(tail):
            for current, batch in enumerate(batches):
                model(input_ids=batch.to(device), use_cache=False)
    except (MemoryError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:
        if observed:
            raise
        raise TailError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
