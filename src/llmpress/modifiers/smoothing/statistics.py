"""Per-channel statistics of a mapping's input over the calibration batches, reduced over every
rank: the activation ranges SmoothQuant scales by and the mean ``|x|`` AWQ searches with."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpress.contract.observation import InputsSeen
from llmpress.errors import SessionError
from llmpress.parallel.distributed import max_across_ranks, min_across_ranks, sum_across_ranks

if TYPE_CHECKING:
    from llmpress.modifiers.smoothing.mappings import Mapping

__all__ = ["ChannelStatistics", "channel_statistics"]


class ChannelStatistics:
    """One mapping's input per channel over the batches it is given: ``min``, ``max`` and, with
    ``abs_mean`` (AWQ's), the mean of ``|x|``, by ``reduced()`` over every rank's batches."""

    def __init__(self, name: str, abs_mean: bool = True) -> None:
        self.name, self.abs_mean = name, abs_mean
        self.batches = 0
        self.tokens = 0
        self.low: torch.Tensor | None = None
        self.high: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        """One batch: ``[batch, tokens, channels]`` (each sequence's ``|x|`` summed on its own and
        added, so the sum does not depend on how the samples are batched) or ``[tokens, channels]``."""
        x = x.detach().float()
        sequences = x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() > 2 else x[None]
        x = x.reshape(-1, x.shape[-1])
        if self.low is None:
            self.low, self.high, self.abs_sum = x.amin(0), x.amax(0), x.new_zeros(x.shape[-1])
        else:
            torch.minimum(self.low, x.amin(0), out=self.low)
            torch.maximum(self.high, x.amax(0), out=self.high)
        for sequence in sequences if self.abs_mean else ():
            self.abs_sum += sequence.abs().sum(0)
        self.tokens += x.shape[0]
        self.batches += 1

    def reduced(self) -> dict[str, torch.Tensor]:
        """``min``, ``max`` and ``abs_mean`` over every rank's batches (torch.distributed; in one
        process, this one's). Call once: the reduction is in place."""
        if self.low is None:
            raise SessionError(f"{self.name}: no balance layer of its mapping saw an input",
                               expected="calibration batches that reach the mapping")
        count = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.low.device)
        min_across_ranks(self.low)
        max_across_ranks(self.high)
        sum_across_ranks(self.abs_sum)
        sum_across_ranks(count)
        if not self.abs_mean:
            return {"min": self.low, "max": self.high}
        return {"min": self.low, "max": self.high, "abs_mean": self.abs_sum / max(float(count.item()), 1.0)}


@torch.no_grad()
def channel_statistics(block: Any, mappings: list[Mapping], batches: int | None = None,
                       abs_mean: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Per input channel of each mapping, over the block's calibration tokens (the first
    ``batches`` batches, default all): ``ChannelStatistics.reduced()``, by smooth layer name.
    Each batch runs through the block only until the last mapping's input has been seen (a
    Llama block stops before its MLP's products: a third of the work)."""
    stats = {m.smooth_name: ChannelStatistics(m.smooth_name, abs_mean) for m in mappings}
    pending: set[str] = set()
    handles = []
    for mapping in mappings:
        def seen(module: nn.Module, args: tuple, name: str = mapping.smooth_name) -> None:
            stats[name].add(args[0])
            pending.discard(name)
            if not pending:
                raise InputsSeen("every mapping's input of this batch is seen")

        handles.append((mapping.balance_seeing_every_token(block.module) or mapping.balance)[0].register_forward_pre_hook(seen))
    try:
        for batch in itertools.islice(block.inputs, batches):  # one batch at a time (on a GPU: one crossing at a time)
            pending.update(stats)
            try:
                block.run(block.module, [batch])
            except InputsSeen:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: found.reduced() for name, found in stats.items()}  # over every rank's batches (torch.distributed)
