"""Fused int4 products: linear layers that read the same input (q/k/v of an attention, gate/up
of an MLP) multiplied by one kernel call.

A decode step of a small model is hundreds of products of a few hundred KB each, and each call
pays a fixed cost (quantizing the row of x, waking the threads) that is a large part of it:
SmolLM2-135M's shapes make 210 int4 products per token, 120 once q/k/v and gate/up are fused.

Which layers read the same input is seen, not assumed from names: ``fuse_projections`` runs one
short forward and groups the int4 layers that received the very same tensor. Each group's
packed weights and tables are concatenated once; every member then keeps row slices of them
(views: no copy, saving and ``dequantized_weight()`` see the member's own rows as before). At
run time (decode-sized inputs; prefill runs each member on its own rows) the first member
called computes the whole group's product and keeps it with its input; the others take their
columns from it when their input is that very tensor (``is``), and otherwise compute their own
rows alone, so a model that calls them otherwise stays correct. The kept product is dropped
once every member has taken its part; a member called again starts a new round.

Under ``torch.compile`` the same Python runs at trace time: the identity test is decided while
tracing and the kept product never outlives the compiled step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from llmpress.runtime import kernels
from llmpress.runtime.linear import QuantizedLinear

__all__ = ["FusedProduct", "fuse_projections", "unfuse"]

logger = logging.getLogger(__name__)


class FusedProduct:
    """One int4 product for several ``QuantizedLinear`` that read the same input."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.group = members[0].int4_group
        self.weight = torch.cat([m.int4_weight for m in members])
        self.table = torch.cat([m.int4_table for m in members], dim=1)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for index, member in enumerate(members):
            stop = start + member.out_features
            self.bounds.append((start, stop))
            # the member's buffers become its rows of the fused tensors (views: one copy in memory)
            member.int4_weight = self.weight[start:stop]
            member.int4_table = self.table[:, start:stop]
            member._fusion = (self, index)
            start = stop
        self.kept: tuple[torch.Tensor, torch.Tensor, frozenset[int]] | None = None  # (input, product, members served)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s product with ``x`` (no bias). Decode-sized inputs share one group
        product; longer ones (prefill) run each member on its own rows, which costs no more
        and keeps no group-sized product alive."""
        member, kept = self.members[index], self.kept
        waiting = kept is not None and index not in kept[2]  # the group's product waits for this member
        if x.numel() > kernels.PREFILL_ROWS * x.shape[-1] or (waiting and kept[0] is not x):
            # prefill, or another input than the waiting product's: its own rows only
            return kernels.int4_matmul(x, member.int4_weight, self.group, member.int4_table)
        if waiting:
            product, served = kept[1], kept[2] | {index}
        else:  # the first member of a round (or one called again: a new round)
            product, served = kernels.int4_matmul(x, self.weight, self.group, self.table), frozenset((index,))
        self.kept = None if len(served) == len(self.members) else (x, product, served)
        start, stop = self.bounds[index]
        return product[..., start:stop].contiguous()

    def dissolve(self) -> None:
        """Every member runs alone again (its buffers stay what they are)."""
        for member in self.members:
            member._fusion = None
        self.kept = None


def _candidates(model: nn.Module) -> list[nn.Module]:
    return [
        m for m in model.modules()
        if isinstance(m, QuantizedLinear) and m.kernel == "int4" and kernels._is_blocks64(m.int4_table)
        and m.scheme.input_activations is None and m.int4_weight.device.type == "cpu"
    ]


def _example_inputs() -> dict[str, Any]:
    return {"input_ids": torch.zeros(1, 2, dtype=torch.long), "use_cache": False}


def fuse_projections(model: nn.Module, inputs: dict[str, Any] | None = None) -> list[FusedProduct]:
    """Fuse the int4 layers of ``model`` that read the same input, as one forward of ``inputs``
    (default: two tokens of id 0) shows them. Layers fuse when their columns, kernel group and
    table kind (with or without zeros) agree. Returns the groups; a model whose forward does
    not run on such inputs is left as it is (logged)."""
    candidates = _candidates(model)
    unfuse(model)
    if len(candidates) < 2:
        return []
    seen: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}  # id(input) -> (input, readers)

    def record(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen.setdefault(id(args[0]), (args[0], []))[1].append(module)

    handles = [m.register_forward_pre_hook(record) for m in candidates]
    try:
        with torch.no_grad():
            model(**(inputs if inputs is not None else _example_inputs()))
    except Exception as exc:  # noqa: BLE001 - any model: fusing is an optimisation, never a failure
        logger.info("int4 layers not fused: the model's forward did not run on a short example (%s)", exc)
        return []
    finally:
        for handle in handles:
            handle.remove()
    groups, placed = [], set()
    for _, readers in seen.values():
        by_kind: dict[tuple, list[nn.Module]] = {}
        for module in dict.fromkeys(readers):  # each once, in call order
            if module in placed:  # called again on another input (a shared block): its first group only
                continue
            key = (module.in_features, module.int4_group, module.int4_table.shape[0])
            by_kind.setdefault(key, []).append(module)
        for members in by_kind.values():
            if len(members) > 1:
                groups.append(FusedProduct(members))
                placed.update(members)
    if groups:
        names = {id(m): n for n, m in model.named_modules()}
        example = ", ".join(names.get(id(m), "?").rsplit(".", 1)[-1] for m in groups[0].members)
        logger.info("fused %d int4 products into %d (e.g. %s)", sum(len(g.members) for g in groups), len(groups), example)
    return groups


def unfuse(model: nn.Module) -> None:
    """Every fused layer of ``model`` runs alone again."""
    for module in model.modules():
        fusion = getattr(module, "_fusion", None)
        if fusion is not None:
            fusion[0].dissolve()
