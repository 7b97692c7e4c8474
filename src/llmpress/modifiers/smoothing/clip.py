"""Weight clipping searched on the layer's output (AutoAWQ's ``auto_clip``), after AWQ's scales.

For each balance layer of the block's mappings and each of its quantization groups (a row for a channel
grid), the range ``[-m, m]`` the weights are clipped to is shrunk step by step (``m`` = the
group's largest ``|w|`` times 1, 0.95, ... 0.55) and the step whose quantized, clipped weights
give the smallest output error on the calibration inputs is kept: ``e G e^T`` per group, with
``e`` the weight error and ``G`` the Gram matrix of the group's input columns (the error of the
group's share of the output; AutoAWQ computes the same sums token by token). AutoAWQ leaves q/k
alone by name, since their error reaches the output through the softmax; here every clipped layer
is checked instead on the output of the module around it (the attention, the MLP) and kept only
where that error is lower. The quantizer after AWQ then rounds the clipped weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.parallel.distributed import sum_across_ranks
from llmpress.quant.observers import fake_quantize_weight
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["clip_", "clip_group", "clip_limits", "group_grams"]

STEPS, MAX_SHRINK = 20, 0.5


def clip_group(args: QuantizationArgs, columns: int) -> int | None:
    """The columns per clipping group, or None where clipping does not apply (a tensor-wide grid,
    a group that does not divide the columns)."""
    if args.strategy == QuantizationStrategy.CHANNEL:
        return columns
    if args.is_grouped and columns % args.group_size == 0:
        return args.group_size
    return None


@torch.no_grad()
def group_grams(block: Any, layers: list[nn.Linear], groups: list[int], batches: list) -> dict[nn.Linear, torch.Tensor]:
    """For each layer, ``X_k^T X_k`` of each of its input groups ``[groups, size, size]`` over
    ``batches``: one run of the block; layers reading the same tensor share the sums."""
    grams: dict[nn.Linear, torch.Tensor] = {}
    seen: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # this batch's inputs (kept: ids stay theirs)

    def hook(layer: nn.Linear, size: int):
        def add(module: nn.Module, args: tuple) -> None:
            found = next((g for x, s, g in seen if x is args[0] and s == size), None)
            if found is None:
                x = args[0].detach().reshape(-1, layer.in_features).float()
                parts = x.reshape(x.shape[0], -1, size).transpose(0, 1)  # [groups, tokens, size]
                found = torch.bmm(parts.transpose(1, 2), parts)
                seen.append((args[0], size, found))
            grams[layer] = grams[layer] + found if layer in grams else found.clone()
        return add

    handles = [layer.register_forward_pre_hook(hook(layer, size)) for layer, size in zip(layers, groups)]
    try:
        for batch in batches:  # through the block, unobserved: the quantizers' statistics see none of it
            seen.clear()
            block.run(block.module, [batch])
    finally:
        for handle in handles:
            handle.remove()
    for layer in layers:  # over every rank's batches (torch.distributed)
        sum_across_ranks(grams[layer])
    return grams


@torch.no_grad()
def clip_limits(weight: torch.Tensor, gram: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """The clipping limit ``[out, groups, 1]`` of each group of ``weight`` ``[out, in]`` with
    the least output error (the largest ``|w|`` where nothing helps)."""
    out, columns = weight.shape
    groups, size = gram.shape[0], gram.shape[1]
    w = weight.float().reshape(out, groups, size)
    original = w.abs().amax(dim=-1, keepdim=True)
    best, best_error = original.clone(), torch.full((out, groups, 1), float("inf"), device=weight.device)
    for step in range(int(MAX_SHRINK * STEPS)):
        limit = original * (1 - step / STEPS)
        clipped = torch.maximum(torch.minimum(w, limit), -limit).reshape(out, columns)
        error = (fake_quantize_weight(clipped, args).reshape(out, groups, size) - w)
        cost = torch.einsum("okg,kgh,okh->ok", error, gram, error).unsqueeze(-1)
        better = cost < best_error
        best = torch.where(better, limit, best)
        best_error = torch.where(better, cost, best_error)
    return best


def clip_(layer: nn.Linear, limits: torch.Tensor) -> None:
    """Clip ``layer``'s weight group by group to ``[-limit, limit]``, in place."""
    out, columns = layer.weight.shape
    w = layer.weight.data.view(out, limits.shape[1], -1)
    limit = limits.to(w.dtype)
    w.copy_(torch.maximum(torch.minimum(w, limit), -limit))
