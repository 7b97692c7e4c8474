"""GPTQ's solves spread over ranks (torch.distributed), so that a layer's solves take 1/N of the time.

GPTQ treats each row of a weight on its own: a row's updates read only the shared Hessian factor
and the row itself, and row-wise qparams (channel, group, NVFP4's groups) are the row's. So a
Hessian whose modules have row-wise qparams is solved by every rank at once, each on its share of
the rows of the stacked matrix (its modules one under the other), and the rows go from each rank
to the others afterwards: the one process's arithmetic row by row, so its checkpoint bit for bit.
Each rank factors the Hessian itself (the ranks' sums are equal, so their factors are).

Other groups (per-tensor qparams, input-major Conv1D weights) go whole to one rank each,
balanced by the solves' cost (``owners``), and come back by broadcast (``share_owned``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmpress.lifecycle.attach import set_module_buffer, set_weight_qparams
from llmpress.models.linear import input_major
from llmpress.parallel.distributed import (
    assign_owners,
    broadcast_object,
    broadcast_tensor_,
    gather_objects,
    rank,
    sum_across_ranks,
    world_size,
)

if TYPE_CHECKING:
    from llmpress.parallel.node import NodeTeam

__all__ = ["RowShare", "owners", "row_splittable", "share_owned"]

ROW_WISE = ("channel", "group", "tensor_group")


def row_splittable(strategy: str, module: nn.Module) -> bool:
    """Whether a group's solve can go to every rank by rows: row-wise qparams, an ``[out, in]`` weight."""
    return world_size() > 1 and strategy in ROW_WISE and not input_major(module)


def owners(groups: dict[tuple, list[str]], pending: dict, split: set[tuple]) -> dict[tuple, int | None]:
    """The rank that solves each group, None for every rank (split by rows) and in one process:
    groups sharing a Hessian go to one rank, the Hessians spread by the solves' cost."""
    if world_size() == 1:
        return dict.fromkeys(groups)
    by_hessian: dict[int, float] = {}
    for key, members in groups.items():
        if key in split:
            continue
        weight = pending[members[0]][0].weight
        columns = weight.shape[0] if key[2] else weight.shape[-1]
        rows = sum(pending[n][0].weight.numel() for n in members) / columns
        by_hessian[key[0]] = by_hessian.get(key[0], 0.0) + columns**3 + rows * columns**2
    hessians = list(by_hessian)
    owner_of = dict(zip(hessians, assign_owners([by_hessian[h] for h in hessians])))
    return {key: None if key in split else owner_of[key[0]] for key in groups}


def share_owned(modules: list[nn.Module], names: list[str], owner: int, losses: dict[str, float]) -> None:
    """Each module's weight, qparams and loss, from the rank that solved it to every other rank."""
    for name, module in zip(names, modules, strict=True):
        broadcast_tensor_(module.weight.data, owner)
        sent = None
        if rank() == owner:
            zero_point = getattr(module, "weight_zero_point", None)
            sent = (module.weight_scale.cpu(), None if zero_point is None else zero_point.cpu(), losses[name])
        scale, zero_point, loss = broadcast_object(sent, owner)
        if rank() != owner:
            device = module.weight.device
            set_module_buffer(module, "weight_scale", scale.to(device))
            set_module_buffer(module, "weight_zero_point", None if zero_point is None else zero_point.to(device))
            losses[name] = loss


@dataclass
class _Rows:
    """One module's result while its rows come from several ranks: the weight on its grid in
    float32 (as one process hands it over), qparams and this rank's part of the loss."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    loss: float = 0.0


@dataclass
class RowShare:
    """A group's rows, split over the ranks: rank r solves rows ``[R r / N, R (r + 1) / N)`` of the
    stacked matrix of ``modules`` (R rows in all)."""

    modules: list[nn.Module]
    names: list[str]
    results: dict[str, _Rows] = field(default_factory=dict)

    def _bounds(self, of_rank: int) -> tuple[int, int]:
        total, size = sum(m.weight.shape[0] for m in self.modules), world_size()
        return total * of_rank // size, total * (of_rank + 1) // size

    def pieces(self, of_rank: int | None = None) -> list[tuple[nn.Module, int, int]]:
        """``(module, first row, end row)`` of each module that ``of_rank``'s share (this rank's
        by default) reaches, in stacking order."""
        lo, hi = self._bounds(rank() if of_rank is None else of_rank)
        found, offset = [], 0
        for module in self.modules:
            rows = module.weight.shape[0]
            a, b = max(lo, offset) - offset, min(hi, offset + rows) - offset
            if a < b:
                found.append((module, a, b))
            offset += rows
        return found

    def take(self, module: nn.Module, a: int, b: int, weight: torch.Tensor, scale: torch.Tensor,
             zero_point: torch.Tensor | None, loss: float) -> None:
        """Rows ``[a, b)`` of ``module``, solved here."""
        name = self.names[self.modules.index(module)]
        rows = self.results.get(name)
        if rows is None:
            full = module.weight.shape[0]
            rows = self.results[name] = _Rows(torch.empty(full, weight.shape[1], dtype=torch.float32, device=weight.device))
            rows.scale = scale.new_empty(full, *scale.shape[1:])
            rows.zero_point = None if zero_point is None else zero_point.new_empty(full, *zero_point.shape[1:])
        rows.weight[a:b] = weight
        rows.scale[a:b] = scale
        if zero_point is not None:
            rows.zero_point[a:b] = zero_point
        rows.loss += loss

    def gather(self, losses: dict[str, float], node: NodeTeam | None = None) -> None:
        """Every rank's rows onto every rank (each rank's, by broadcast from it, in rank order),
        the losses summed; then each module takes its result as one process would. ``node``:
        the ranks share this machine's memory, and the results meet there instead (``_meet``)."""
        templates = {}
        if all(self.pieces(r) for r in range(world_size())):
            # every rank solved rows of this group: a missed module's qparams are shaped as the
            # ones here (a row each, the same columns and dtypes: one scheme, one Hessian)
            some = next(iter(self.results.values()))
            for name, module in zip(self.names, self.modules, strict=True):
                templates[name] = ((module.weight.shape[0], *some.scale.shape[1:]), some.scale.dtype,
                                   None if some.zero_point is None else some.zero_point.dtype)
        else:
            for found in gather_objects({n: (tuple(r.scale.shape), r.scale.dtype, None if r.zero_point is None else r.zero_point.dtype)
                                         for n, r in self.results.items()}):
                templates.update(found)
        for name, module in zip(self.names, self.modules, strict=True):  # a rank whose share missed a module
            if name not in self.results:
                shape, dtype, zero_dtype = templates[name]
                device = module.weight.device
                self.results[name] = _Rows(torch.empty(module.weight.shape, dtype=torch.float32, device=device),
                                           torch.empty(shape, dtype=dtype, device=device),
                                           None if zero_dtype is None else torch.empty(shape, dtype=zero_dtype, device=device))
        summed = None
        if node is not None and all(r.weight.device.type == "cpu" for r in self.results.values()):
            summed = self._meet(node)  # None where the shared memory has no room
        if summed is None:
            for source in range(world_size()):
                for module, a, b in self.pieces(source):
                    rows = self.results[self.names[self.modules.index(module)]]
                    for tensor in (rows.weight, rows.scale, rows.zero_point):
                        if tensor is not None:
                            broadcast_tensor_(tensor[a:b], source)
            summed = sum_across_ranks(torch.tensor([self.results[n].loss for n in self.names], dtype=torch.float64))
        for index, (name, module) in enumerate(zip(self.names, self.modules, strict=True)):
            rows = self.results.pop(name)
            set_weight_qparams(module, rows.weight, rows.scale, rows.zero_point)
            losses[name] = float(summed[index])

    def _meet(self, node: NodeTeam) -> torch.Tensor | None:
        """Each module's weight, scale and zero point in one buffer every rank maps, each rank
        writing its rows there, then copying the others' rows out beside its own. (The modules
        keep copies, not the shared memory: a later stage that prunes or rescales a weight in
        place would otherwise write into every rank's.) Returns the losses summed over the ranks,
        in rank order (None, on every rank, where the shared memory has no room)."""
        parts = [(name, kind, getattr(self.results[name], kind)) for name in self.names
                 for kind in ("weight", "scale", "zero_point") if getattr(self.results[name], kind) is not None]
        offsets, size = [], 0
        for _, _, tensor in parts:
            size = -(-size // 64) * 64  # aligned for any dtype
            offsets.append(size)
            size += tensor.numel() * tensor.element_size()
        losses_at = -(-size // 64) * 64
        found = node.tensors([((losses_at + 8 * node.size * len(self.names),), torch.uint8)])
        if found is None:
            return None
        buffer, views = found[0], {}
        for (name, kind, tensor), offset in zip(parts, offsets, strict=True):
            views[name, kind] = buffer[offset : offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        losses = buffer[losses_at:].view(torch.float64).view(node.size, len(self.names))
        for module, a, b in self.pieces():
            name = self.names[self.modules.index(module)]
            for kind in ("weight", "scale", "zero_point"):
                if (name, kind) in views:
                    views[name, kind][a:b].copy_(getattr(self.results[name], kind)[a:b])
        losses[node.rank].copy_(torch.tensor([self.results[n].loss for n in self.names], dtype=torch.float64))
        node.sync()
        for source in range(node.size):  # the other ranks' rows, into this rank's results beside its own
            for module, a, b in self.pieces(source) if source != node.rank else ():
                name = self.names[self.modules.index(module)]
                for kind in ("weight", "scale", "zero_point"):
                    if (name, kind) in views:
                        getattr(self.results[name], kind)[a:b].copy_(views[name, kind][a:b])
        summed = losses[0].clone()
        for other in range(1, node.size):
            summed.add_(losses[other])
        return summed
