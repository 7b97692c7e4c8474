"""Hessians of module inputs (``2/n * X^T X``), one per distinct input.

Modules that read the same input tensor in the same forward (q/k/v read the normed hidden
states, as do gate/up) share one accumulator: it is computed once per batch, not once per module,
and GPTQ can then treat the group as one wide matrix.

Under torch.distributed each rank accumulates its share of the batches; ``agree`` gives every
rank the same accumulators (an expert no token of this rank reached gets an empty one) and
``reduce`` sums one onto the rank that solves with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmpress import native
from llmpress.errors import SessionError
from llmpress.parallel.distributed import alike_on_every_rank, gather_objects, is_distributed, sum_across_ranks

if TYPE_CHECKING:
    from llmpress.parallel.node import NodeTeam

__all__ = ["HessianAccumulator", "HessianCollector"]


TRIANGLE_BLOCK = 128  # wider inputs accumulate only the upper triangle, block by block
PRODUCTS_BYTES = 32 << 20  # the float32 products of one batched call, at most (one, whatever its size)


class HessianAccumulator:
    """Running ``X^T X`` of one input. Wide inputs accumulate only the blocks on and above the
    diagonal, each row block its own tensor (the rest is their mirror): for down_proj-sized
    inputs ~45% fewer FLOPs in the most expensive step of GPTQ calibration, still as plain
    matrix products, and about half the memory of the whole matrix (hidden 2048: 134 MB, not
    254, for the MLP's 5632-wide input).

    Each sample's product (a batch of sequences: each sequence's) is taken in float32 and added
    to a float64 sum: the sum then depends neither on the order the samples come in nor on how
    they are batched (to float32 precision, which is what the solve gets), so N ranks, each
    summing its share, give the Hessian one process gives, at any batch size, and GPTQ the same
    integers. A float32 running sum drifts with the order by a few units in the last place,
    which is enough to flip some roundings: 8% of the int4 words of the test model, and its
    perplexity by 0.01 between batch sizes 1 and 4. A product per batch of two drifts with
    which samples share a batch: SmoothQuant + GPTQ W8A8 on the tiny trained model read
    63.675-63.684 over 8 shuffles of its calibration samples, against 63.6754 for every shuffle
    and batch size with a product per sample (which costs ~10% more in this step). Inputs
    without a sample dimension (an MoE expert's routed tokens) take one product per batch.
    bf16 inputs on a CPU with AVX-512 BF16 take ``native.add_gram_bf16_``: the same float32
    sums per sequence from the bf16 values (up to their order), without a float32 copy, on AMX
    tiles where the CPU has them (2.4x faster than the float32 route on this machine's cores)."""

    def __init__(self, columns: int, device: torch.device) -> None:
        self.columns, self.device = columns, device
        self.samples = 0
        self.members: list[str] = []
        self._result: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None  # per input channel, applied when finished (scale_inputs)
        self.node: NodeTeam | None = None  # the ranks that map the finished Hessian (``_reduce_on_node``)
        edges = list(range(0, columns, TRIANGLE_BLOCK)) + [columns]
        # up to two blocks wide, the whole product is as fast as its triangle
        spans = list(zip(edges[:-1], edges[1:])) if columns > 2 * TRIANGLE_BLOCK else [(0, columns)]
        # rows start:end, columns start: (the whole matrix when it is one block)
        self._rows = [(start, end, torch.zeros(end - start, columns - start, dtype=torch.float64, device=device))
                      for start, end in spans]

    def add(self, x: torch.Tensor) -> None:
        if self._scale is not None:
            raise SessionError("a Hessian took inputs after they were rescaled", expected="scale_inputs after the last add")
        if x.numel() == 0:  # an expert no token of this batch reached
            return
        x = x.detach().to(device=self.device)
        sequences = x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() > 2 else x[None]
        self.samples += sequences.shape[0] * sequences.shape[1]
        # bf16 inputs on a CPU with bf16 units: exact products summed in float32, at twice the rate
        if native.add_gram_bf16_([rows for _, _, rows in self._rows], [start for start, _, _ in self._rows], sequences):
            return
        sequences = sequences.to(torch.float32)
        for start, end, rows in self._rows:
            # a batched product of several sequences at once (each its own float32 product, the
            # very bits of one product per sequence) runs ~25% faster than one call per sequence
            step = max(1, PRODUCTS_BYTES // ((end - start) * (self.columns - start) * 4))
            for first in range(0, sequences.shape[0], step):
                part = sequences[first : first + step]
                for product in torch.bmm(part[:, :, start:end].transpose(1, 2), part[:, :, start:]):
                    native.add_float32_(rows, product)

    def scale_inputs(self, factor: torch.Tensor) -> None:
        """The inputs were ``x * factor`` per channel all along (a smoothing scale folded in after
        the last ``add``): the Hessian becomes ``diag(f) H diag(f)``, applied when finished, after
        any ``reduce``, so that every rank sums what one process sums."""
        factor = factor.detach().to(device=self.device, dtype=torch.float64).reshape(-1)
        if factor.numel() != self.columns:
            raise SessionError("a Hessian's input scale does not fit", got=f"{factor.numel()} channels", expected=str(self.columns))
        self._scale = factor if self._scale is None else self._scale * factor

    def reduce(self, dst: int | None = None, node: NodeTeam | None = None) -> None:
        """Sum every rank's running ``X^T X`` and token count onto rank ``dst``, or onto every
        rank for None (a no-op in one process); with ``dst``, the other ranks' sums are then
        meaningless. ``node`` (onto every rank, host memory): the ranks share this machine's
        memory, and the sum is taken there (``_reduce_on_node``) instead of through the group's
        collectives."""
        if not is_distributed():
            return
        if node is not None and dst is None and self.device.type == "cpu" and self._result is None:
            buffers = node.tensors([((node.size, sum(rows.numel() for _, _, rows in self._rows) + 1), torch.float64),
                                    ((self.columns, self.columns), torch.float32)])
            if buffers is not None:  # else no room in the shared memory: through gloo
                self._reduce_on_node(node, *buffers)
                return
        samples = torch.tensor([float(self.samples)], dtype=torch.float64, device=self.device)
        for _, _, rows in self._rows:
            sum_across_ranks(rows, dst=dst)
        sum_across_ranks(samples, dst=dst)
        self.samples = int(samples.item())

    def _reduce_on_node(self, node: NodeTeam, slots: torch.Tensor, hessian: torch.Tensor) -> None:
        """The finished float32 Hessian, once on this machine, in memory every rank maps. Row
        block ``i`` is summed by the rank ``node.mine(i)`` names: each rank puts the float64 sums
        of the blocks others sum in its slot of a shared buffer (freeing each as it goes), then
        adds up its own blocks over the ranks in rank order (its own sums from its memory: the
        sum gloo's all-reduce takes for two ranks) and writes them narrowed, as ``result()``
        does. ``result()`` then returns the shared Hessian; GPTQ factors it in place, all ranks
        together (``parallel/node.py``)."""
        spans, kept, offset = [], {}, 0  # (``slots``: the pages a rank never writes take no memory)
        for index, (start, end, rows) in enumerate(self._rows):
            if node.mine(index):
                kept[index] = rows
            else:
                slots[node.rank, offset : offset + rows.numel()].copy_(rows.view(-1))
            spans.append((start, end, offset, rows.shape))
            offset += rows.numel()
        self._rows = []
        slots[node.rank, -1] = float(self.samples)
        node.sync()
        samples = float(slots[:, -1].sum())
        for index, (start, end, offset, shape) in enumerate(spans):
            if index not in kept:
                continue
            parts = [kept.pop(index).view(-1) if other == node.rank else slots[other, offset : offset + shape.numel()]
                     for other in range(node.size)]
            summed = parts[0] if node.rank == 0 else parts[0].clone()
            for part in parts[1:]:
                summed.add_(part)
            self._narrow(hessian, start, end, summed.view(shape), samples)
        node.sync()
        self.samples = int(samples)
        self._result, self.node = hessian, node

    def _narrow(self, hessian: torch.Tensor, start: int, end: int, rows: torch.Tensor, samples: float) -> None:
        """Row block ``start:end`` of the float64 sum (its columns ``start:``, or the whole matrix
        as one block) into the float32 ``hessian``, scaled, with its mirror below the diagonal."""
        if self._scale is not None:
            rows.mul_(self._scale[start:end, None]).mul_(self._scale[start:])
        rows.mul_(2.0 / max(samples, 1))
        if rows.shape[1] == self.columns and start == 0 and end == self.columns:
            hessian.copy_(rows)
            return
        hessian[start:end, start:].copy_(rows)
        diagonal = hessian[start:end, start:end]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).t())
        hessian[end:, start:end].copy_(hessian[start:end, end:].t())

    def result(self) -> torch.Tensor:
        """The Hessian ``2/n * X^T X`` in float32, finished on first call: accumulation ends.
        Each float64 row block is freed once narrowed, and the lower triangle is the upper one's
        mirror, copied block by block (exact in float32: no whole-matrix temporary)."""
        if self._result is None:
            hessian = torch.empty(self.columns, self.columns, dtype=torch.float32, device=self.device)
            while self._rows:
                start, end, rows = self._rows.pop(0)
                self._narrow(hessian, start, end, rows, self.samples)
                del rows
            self._result = hessian
        return self._result


class HessianCollector:
    """The Hessian of each observed module's input. Modules fed the very same input tensor in
    the first forward (q/k/v, gate/up) share one accumulator, fed once per batch."""

    def __init__(self, offload: bool = False) -> None:
        self.offload = offload
        self.of_module: dict[str, HessianAccumulator] = {}
        self._leader: dict[str, bool] = {}  # True for the module that feeds its shared accumulator
        self._first_inputs: dict[int, tuple[torch.Tensor, HessianAccumulator]] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        """``x``, the input of module ``name`` in one forward."""
        if name not in self.of_module:  # first batch: find who shares this input tensor
            shared = self._first_inputs.get(id(x))
            if shared is not None and shared[0] is x:
                self.of_module[name] = shared[1]
                self._leader[name] = False
            else:
                device = torch.device("cpu") if self.offload else x.device
                accumulator = HessianAccumulator(x.shape[-1], device)
                self._first_inputs[id(x)] = (x, accumulator)
                self.of_module[name] = accumulator
                self._leader[name] = True
            self.of_module[name].members.append(name)
        if self._leader[name]:
            self.of_module[name].add(x)

    def scale_inputs(self, names: list[str], factor: torch.Tensor) -> None:
        """``HessianAccumulator.scale_inputs`` for the inputs of ``names`` (each shared one once)."""
        for accumulator in {id(a): a for n in names if (a := self.of_module.get(n)) is not None}.values():
            accumulator.scale_inputs(factor)

    def agree(self, names: list[str], device: torch.device) -> None:
        """Under torch.distributed: each of ``names`` that any rank has an accumulator for gets
        one here too, shared by the same modules (zeros where this rank's share never reached it:
        an MoE expert its tokens were not routed to). Called by every rank with the same ``names``."""
        if not is_distributed():
            return
        mine = sorted({(tuple(a.members), a.columns) for n in names if (a := self.of_module.get(n)) is not None})
        if alike_on_every_rank(mine):  # the usual case (a dense layer): nothing to add, no gather
            return
        for members, columns in sorted(set().union(*map(set, gather_objects(mine)))):
            present = [m for m in members if m in self.of_module]
            if present and any(tuple(self.of_module[m].members) != members for m in present):
                raise SessionError(
                    f"the ranks group the Hessians of {', '.join(members)} differently",
                    got="modules sharing an input on one rank and not on another",
                    expected="the same model on every rank",
                )
            if present:
                continue
            accumulator = HessianAccumulator(columns, torch.device("cpu") if self.offload else device)
            accumulator.members = list(members)
            for member in members:
                self.of_module[member] = accumulator
                self._leader[member] = member == members[0]

    def end_of_first_pass(self) -> None:
        """Release the input tensors kept to detect sharing."""
        self._first_inputs.clear()

    def release(self, names: list[str]) -> None:
        """Free the Hessians of ``names``."""
        for name in names:
            self.of_module.pop(name, None)
            self._leader.pop(name, None)
        self._first_inputs.clear()
