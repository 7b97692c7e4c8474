"""AutoRound's loop over one block: signed gradient descent on the rounding of its weights.

The target is the unquantized block's output on the unquantized model's hidden states (the
modifier carries that stream from block to block); the prediction is the block with its tuned
weights on the inputs the compressed blocks before it give (``block.inputs``), so each block
also corrects the error of those before it. Each step draws ``batch_size`` samples (a shuffled
order, taken in runs, reshuffled when fewer remain), measures the mean squared error of the
block's output, and moves every offset and scale by ``lr`` times the sign of its gradient, the
rate falling linearly to zero. The values with the lowest loss seen are kept (the loss is taken
before each step, so round-to-nearest itself, step 0, can win).

Samples are stacked into one forward where the batches differ only in their hidden states
(arguments such as rotary tables are shared, and none has a dimension per sample); otherwise a
step runs its batches one by one and sums their gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from llmpress import native
from llmpress.contract.block import CalibrationBlock, Inputs, hidden_of
from llmpress.contract.observation import primary_input, with_primary_input
from llmpress.models.experts import routed_experts_only
from llmpress.models.linear import linear_weight
from llmpress.modifiers.autoround.rounding import TunedWeight
from llmpress.parallel.distributed import is_main_process, sum_across_ranks, world_size
from llmpress.quant.qdq import fake_quantize_activation
from llmpress.quant.scheme import QuantizationArgs

__all__ = ["TuningResult", "sample_order", "tune_block"]


@dataclass
class TuningResult:
    first_loss: float  # the untuned rounding's loss on the first step's samples
    best_loss: float
    best_step: int
    fp_outputs: list[torch.Tensor]  # the unquantized block's hidden states: the next block's targets' inputs


def sample_order(units: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The units each step takes: a seeded shuffle taken ``batch_size`` at a time, reshuffled
    when fewer than that remain (all of them per step when there are fewer in all)."""
    generator = torch.Generator().manual_seed(seed)
    take = min(batch_size, units)
    order: list[int] = []
    steps_taken: list[list[int]] = []
    for _ in range(steps):
        if len(order) < take:
            order = torch.randperm(units, generator=generator).tolist()
        steps_taken.append(order[:take])
        order = order[take:]
    return steps_taken


class _Samples:
    """The block's inputs as units a step draws from: single samples stacked into one tensor
    kept where the pipeline keeps its inputs (``home``; each step's rows go to the block's
    device), or whole batches run one by one."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self.home = getattr(inputs, "home", None)  # on a device (OnDevice): the pipeline's inputs stay home
        stored = getattr(inputs, "inner", inputs)
        batches = [stored[i] for i in range(len(stored))]  # read once (spilled ones come back from their file)
        self.stacked = _stackable(batches)
        if self.stacked:
            self.hidden = torch.cat([primary_input(*batch) for batch in batches])
            self.rows = [1] * self.hidden.shape[0]
        else:
            self.rows = [primary_input(*batch).shape[0] for batch in batches]

    @property
    def units(self) -> int:
        return len(self.rows)

    def per_step(self, samples: int) -> int:
        """Units a step takes for ``samples`` samples (whole batches: as many as hold them)."""
        return samples if self.stacked else max(1, math.ceil(samples / max(self.rows[0], 1)))

    def forwards(self, indices: list[int]) -> Iterator[tuple[tuple, dict, list[int]]]:
        """``(args, kwargs, which targets)`` for the forwards of one step."""
        if self.stacked:
            hidden = self.hidden[indices]
            if self.home is not None:
                hidden = self.inputs.hidden_over(hidden)
            args, kwargs = with_primary_input(*self.inputs[0], hidden)
            yield args, kwargs, indices
            return
        for index in indices:
            yield (*self.inputs[index], [index])


def _stackable(inputs: Inputs) -> bool:
    """Whether the batches differ only in their hidden states, each of one sample's shape, and
    no other argument has a dimension per sample (so it broadcasts over a stack of samples)."""
    first_hidden = primary_input(*inputs[0])
    if not isinstance(first_hidden, torch.Tensor) or first_hidden.dim() < 2:
        return False
    rows = first_hidden.shape[0]
    first = with_primary_input(*inputs[0], None)
    for args, kwargs in inputs:
        hidden = primary_input(args, kwargs)
        if hidden.shape[1:] != first_hidden.shape[1:]:
            return False
        if not _same_arguments(with_primary_input(args, kwargs, None), first, rows):
            return False
    return True


def _same_arguments(a: Any, b: Any, rows: int) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        per_sample = rows > 1 and a.dim() > 0 and a.shape[0] == rows
        return not per_sample and (a is b or (a.shape == b.shape and torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_arguments(x, y, rows) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k], rows) for k in a)
    return a is b or a == b


@contextmanager
def _tuned_forwards(modules: dict[nn.Module, tuple[TunedWeight, QuantizationArgs | None]]) -> Iterator[None]:
    """Each module computes with its tuned weight (its input fake-quantized where the scheme
    quantizes inputs, on each batch's own range), the block's own parameters frozen meanwhile."""

    def forward_of(module: nn.Module, tuned: TunedWeight, inputs: QuantizationArgs | None):
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = linear_weight(tuned.dequantized().to(x.dtype), module)  # a Conv1D's [in, out] as [out, in]
            if inputs is not None:
                x = fake_quantize_activation(x, inputs)
            return F.linear(x, weight, module.bias)
        return forward

    own = {module: module.__dict__.get("forward") for module in modules}  # an instance's own forward (a dispatch hook's)
    for module, (tuned, inputs) in modules.items():
        module.forward = forward_of(module, tuned, inputs)
    try:
        yield
    finally:
        for module, forward in own.items():
            del module.forward
            if forward is not None:
                module.forward = forward


@contextmanager
def _frozen(block: nn.Module) -> Iterator[None]:
    """The block's own parameters take no gradient meanwhile (only the tuned values do)."""
    trainable = [p for p in block.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


def tune_block(block: CalibrationBlock, modules: dict[nn.Module, tuple[TunedWeight, QuantizationArgs | None]],
               fp_hidden: list[torch.Tensor] | None, iters: int, batch_size: int, lr: float, seed: int,
               autocast: bool = False) -> TuningResult:
    """Tune ``modules`` (the block's, each with its ``TunedWeight`` and its input args or None)
    to reproduce the unquantized block, which runs on ``fp_hidden`` (default: the block's inputs).
    Leaves each ``TunedWeight`` at its best values. Under torch.distributed each rank draws
    ``batch_size / ranks`` samples a step from its share, and the loss and gradients are those of
    the ranks' samples together. An MoE block's experts see only their routed tokens.
    ``autocast``: a float32 block's tuning forwards and backwards run in bf16 where the device
    computes it natively (the targets and the loss stay in float32)."""
    inputs = block.inputs
    home = getattr(inputs, "home", None)  # on a device: what is kept stays where the pipeline keeps its inputs
    with block.unobserved(), routed_experts_only(block.module), torch.no_grad():
        targets = []
        for index in range(len(inputs)):
            batch = inputs[index]
            hidden = primary_input(*batch) if fp_hidden is None else fp_hidden[index].to(primary_input(*batch).device)
            args, kwargs = with_primary_input(*batch, hidden)
            output = hidden_of(block.module(*args, **kwargs))
            targets.append(output if home is None else output.to(home))
    if not modules or iters <= 0:
        return TuningResult(math.inf, math.inf, -1, targets)
    samples = _Samples(inputs)
    target = None
    if samples.stacked:  # one tensor; each batch's targets a view of it
        target = torch.cat(targets)
        targets = list(target.split([t.shape[0] for t in targets]))
    numel = [target[0].numel()] * target.shape[0] if target is not None else [t.numel() for t in targets]
    params = [p for tuned, _ in modules.values() for p in tuned.parameters]
    best = (math.inf, -1, [tuned.state() for tuned, _ in modules.values()])
    first = math.inf
    order = sample_order(samples.units, samples.per_step(math.ceil(batch_size / world_size())), iters, seed)
    with block.unobserved(), routed_experts_only(block.module), _frozen(block.module), _tuned_forwards(modules), \
            torch.enable_grad(), _autocast(block.module, autocast):
        bar = tqdm(order, desc=f"AutoRound layer {block.index}", unit="step", leave=False, disable=not is_main_process())
        for step, indices in enumerate(bar):
            elements = sum_across_ranks(torch.tensor([float(sum(numel[i] for i in indices))], dtype=torch.float64))
            squared = torch.zeros(1, dtype=torch.float64)
            for args, kwargs, which in samples.forwards(indices):
                output = hidden_of(block.module(*args, **kwargs)).float()
                expected = target[which] if target is not None else targets[which[0]]
                loss = F.mse_loss(output, expected.to(output.device, torch.float32), reduction="sum")
                (loss / float(elements)).backward()
                squared += loss.detach().double().cpu()
            _reduce_gradients(params)
            loss_value = float(sum_across_ranks(squared)) / float(elements)
            if step == 0:
                first = loss_value
            if loss_value < best[0]:
                best = (loss_value, step, [tuned.state() for tuned, _ in modules.values()])
                bar.set_postfix_str(f"loss {first:.3g} -> {loss_value:.3g}", refresh=False)
            rate = lr * (1 - step / iters)
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.sub_(p.grad.sign(), alpha=rate)
                        p.grad = None
            for tuned, _ in modules.values():
                tuned.clamp_()
    for (tuned, _), state in zip(modules.values(), best[2]):
        tuned.load(state)
    return TuningResult(first, best[0], best[1], targets)


def _autocast(block: nn.Module, wanted: bool) -> AbstractContextManager:
    """bf16 autocast for a float32 block on a device with native bf16 products (a CPU with
    AVX-512 BF16 or AMX; a CUDA GPU that has them), else nothing."""
    parameter = next(block.parameters(), None)
    if not wanted or parameter is None or parameter.dtype != torch.float32:
        return nullcontext()
    device = parameter.device
    native_bf16 = native.bf16_native() if device.type == "cpu" else device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16) if native_bf16 else nullcontext()


def _reduce_gradients(params: list[torch.Tensor]) -> None:
    """Under torch.distributed: every rank steps on the gradient summed over the ranks' samples,
    in one reduction (a tensor no sample of a rank reached counts zero there)."""
    if world_size() == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    sum_across_ranks(flat)
    for p, grad in zip(params, flat.split([p.numel() for p in params])):
        p.grad = grad.view_as(p)
