"""How AWQ scores a candidate scale: the output error of the smallest module holding the
balance layers against its full-precision output (``RunScore``, the module run on its cached
inputs), or for a single Linear from its inputs' Hessian (``LinearScore``); and which inputs
and which module the score uses."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpress.contract.block import hidden_of, tokens_per_batch
from llmpress.contract.observation import primary_input
from llmpress.models.experts import ExpertMLP, routed_experts_only
from llmpress.modifiers.hessians import HessianAccumulator
from llmpress.parallel.distributed import sum_across_ranks

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["LinearScore", "RunScore", "enclosing_module", "scoring_owner", "spread"]


def scoring_owner(block: CalibrationBlock, balance_names: list[str], prefix: str) -> nn.Module:
    """The smallest module of the block holding every balance layer (the layer itself for one)."""
    local = [n.removeprefix(prefix).split(".") for n in balance_names]
    common = os.path.commonprefix(local) if len(local) > 1 else local[0]
    return block.module.get_submodule(".".join(common)) if common else block.module


def _merged(inputs: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """The batches' ``(args, kwargs)`` as one batch where they stack (every tensor the same
    shape in every batch, joined along the batch dimension; everything else equal): one forward
    per candidate instead of one per batch. Otherwise as they are."""
    if len(inputs) < 2:
        return inputs
    try:
        args = _joined([a for a, _ in inputs])
        keys = inputs[0][1].keys()
        if any(k.keys() != keys for _, k in inputs):
            return inputs
        kwargs = {key: _joined([k[key] for _, k in inputs]) for key in keys}
    except (ValueError, RuntimeError):
        return inputs
    return [(args, kwargs)]


def _joined(values: list[Any]) -> Any:
    """One value from each batch's (``_merged``); ValueError where they do not stack."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0 or any(not isinstance(v, torch.Tensor) or v.shape != first.shape for v in values):
            raise ValueError
        if first.shape[0] == 1 and all(v is first for v in values):
            return first  # shared by every batch and broadcast over it (rotary cos / sin)
        return torch.cat(values, dim=0)
    if isinstance(first, (tuple, list)) and all(isinstance(v, type(first)) and len(v) == len(first) for v in values):
        return type(first)(_joined(list(parts)) for parts in zip(*values))
    if any(v is not first and v != first for v in values):
        raise ValueError
    return first


def enclosing_module(block: nn.Module, name: str) -> nn.Module:
    """The innermost module around the layer ``name`` that is not itself a Linear (the
    attention, the MLP; the block at most)."""
    parts = name.split(".")[:-1]
    while parts:
        module = block.get_submodule(".".join(parts))
        if not isinstance(module, (nn.Linear, ExpertMLP)):  # an expert is run by its MoE layer, not called
            return module
        parts.pop()
    return block


def spread(inputs: list[tuple[tuple, dict]], tokens: int | None) -> list[tuple[tuple, dict]]:
    """Batches spread evenly over the calibration set holding about ``tokens`` tokens (at least
    one batch; all of them for None or when they hold no more)."""
    sizes = [max(rows, 0) for rows in tokens_per_batch(inputs)]  # spilled or on a GPU: nothing read back
    if tokens is None or sum(sizes) <= tokens or not inputs:
        return inputs
    count = max(1, round(len(inputs) * tokens / sum(sizes)))
    return [inputs[round(i * len(inputs) / count)] for i in range(count)]


def _runs(inputs: list[tuple[tuple, dict]], tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` runs of the batches, each of at most ``tokens`` tokens (a
    larger batch alone)."""
    runs, start, held = [], 0, 0
    for index, (args, kwargs) in enumerate(inputs):
        x = primary_input(args, kwargs)
        size = x.shape[:-1].numel() if isinstance(x, torch.Tensor) else 0
        if index > start and held + size > tokens:
            runs.append((start, index))
            start, held = index, 0
        held += size
    return runs + ([(start, len(inputs))] if inputs else [])


class RunScore:
    """Mean squared error of the owner's output against its full-precision output, the owner run
    on its cached inputs, joined into batches of up to ``joined_tokens`` tokens where that gives
    the same output (one forward per joined batch)."""

    def __init__(self, block: CalibrationBlock, owner: nn.Module, joined_tokens: int = 4096) -> None:
        self.block, self.owner = block, owner
        inputs = block.inputs_to(owner)
        with routed_experts_only(owner):
            reference = [hidden_of(out).float() for out in block.run(owner, inputs)]  # batches may differ in length
        self.inputs, self.reference = [], []
        for start, stop in _runs(inputs, joined_tokens):
            part, merged = inputs[start:stop], _merged(inputs[start:stop])
            if merged is not part and self._gives_the_same(merged, reference[start:stop]):
                self.inputs += merged
                self.reference.append(torch.cat(reference[start:stop]))
            else:  # one run per batch, as given
                self.inputs += part
                self.reference += reference[start:stop]

    def _gives_the_same(self, merged: list, reference: list[torch.Tensor]) -> bool:
        try:
            with routed_experts_only(self.owner):
                joined = hidden_of(self.block.run(self.owner, merged)[0]).float()
            return torch.allclose(joined, torch.cat(reference), rtol=1e-4, atol=1e-5)
        except Exception:  # a joined input the owner cannot take
            return False

    def __call__(self) -> float:
        total, count = 0.0, 0
        with routed_experts_only(self.owner):  # the same output; experts compute only their tokens
            outputs = self.block.run(self.owner, self.inputs)
        for out, ref in zip(outputs, self.reference):
            out = hidden_of(out).float()
            # a non-finite output gives an infinite error (summed, not returned early: every
            # rank of a distributed run takes part in the sum)
            total += float((out - ref).square().sum()) if torch.isfinite(out).all() else float("inf")
            count += ref.numel()
        summed = sum_across_ranks(torch.tensor([total, float(count)], dtype=torch.float64))
        total, count = float(summed[0]), float(summed[1])
        return total / max(count, 1.0) if total == total else float("inf")


class LinearScore:
    """The same error for a single Linear owner, from its inputs' Hessian ``H = 2/n X^T X`` (GPTQ's
    accumulator): the output error ``X (W' - W)^T`` over ``n`` tokens and ``out`` rows has mean
    square ``sum((E H) * E) / (2 out)`` with ``E = W' - W``, so each candidate costs one
    ``out x in x in`` product instead of a run over every token."""

    def __init__(self, block: CalibrationBlock, owner: nn.Linear, original: torch.Tensor) -> None:
        self.owner, self.original = owner, original.float()
        inputs = HessianAccumulator(owner.in_features, original.device)
        # streamed: one batch of the block at a time, the owner's inputs summed as they come
        handle = owner.register_forward_pre_hook(lambda module, args: inputs.add(args[0]))
        try:
            for batch in block.inputs:
                block.run(block.module, [batch])
        finally:
            handle.remove()
        inputs.reduce()  # over every rank's batches (torch.distributed)
        self.hessian = inputs.result()

    def __call__(self) -> float:
        error = self.owner.weight.detach().float() - self.original
        value = float(((error @ self.hessian) * error).sum()) / (2 * self.owner.out_features)
        return value if value == value else float("inf")  # NaN: not a candidate
