"""What a mixed-precision choice weighs, measured in memory bounded by one layer.

Each option's cost (``sensitivity.option_costs``) needs two things of a module: the squared
gradient of the loss at its outputs, which only a backward pass through the whole model gives,
and the Hessian of its inputs, an ``in x in`` matrix. Summed over the calibration tokens for
every module at once, the Hessians outweighed the model (a Llama-3-8B layer's float64 sums take
about 1 GB; all 32 layers' at once, 32 GB). So the calibration sequences go through twice:

1. the whole model, forward and backward, one sequence at a time, each block's activations
   computed again in the backward pass rather than kept (``_recomputed``): each module's squared
   output gradients (a vector per module), the inputs of the first repeated block, and the
   Hessians of the targeted modules outside the blocks (an ``lm_head``);
2. the blocks one after another on those inputs, each block's outputs the next one's inputs (as
   the layerwise pipeline runs them, unquantized): a block's Hessians are summed over the
   sequences, its modules weighed, and the Hessians freed before the next block.

Under torch.distributed each rank runs every ``world_size``-th sequence; the gradients and token
counts are summed over the ranks, and each Hessian onto every rank, each weighing a share of its
modules' rows (or, where an option's rounding is not row by row, onto the one rank that weighs
its modules).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from llmpress.contract.block import BlockArguments, find_blocks, hidden_of
from llmpress.contract.observation import primary_input, with_primary_input
from llmpress.memory import release_free_memory
from llmpress.models.linear import linear_weight
from llmpress.modifiers.hessians import HessianAccumulator, HessianCollector
from llmpress.modifiers.mixed_precision.menu import MenuOption
from llmpress.modifiers.mixed_precision.sensitivity import Rounding, option_costs, round_to_nearest, shape_of
from llmpress.parallel.distributed import assign_owners, gather_objects, is_main_process, rank, sum_across_ranks, world_size
from llmpress.parallel.node import node_team
from llmpress.quant.groups import shared_columns

__all__ = ["Measured", "measure"]


@dataclass
class Measured:
    """Each module's cost per option (``costs``, the same on every rank), the first module that
    read its input in a forward (``input_of``: modules reading one input share a Hessian, and
    vLLM serves them as one layer), each module's summed squared output gradients and the
    calibration tokens counted."""

    costs: dict[str, list[float]]
    input_of: dict[str, str]
    output_grads: dict[str, torch.Tensor]
    tokens: int


def measure(model: nn.Module, modules: dict[str, nn.Module], rows: list[torch.Tensor], options: list[MenuOption],
            rounding: Rounding = round_to_nearest) -> Measured:
    """Each of ``modules``' costs under each of ``options`` on ``rows`` (token-id sequences, the
    same on every rank), its rounding error made by ``rounding``. The model is left as it was;
    no weight gradient is computed."""
    blocks = find_blocks(model)
    in_blocks = set(blocks.modules()) if blocks is not None else set()
    inside = [n for n, m in modules.items() if m in in_blocks]
    mine = rows[rank()::world_size()]
    first_inputs: list[tuple[tuple, dict]] | None = [] if inside else None
    outside_hessians, grads, tokens, arguments = _backward_pass(model, modules, mine, [n for n in modules if n not in inside],
                                                                blocks, first_inputs)
    for total in grads.values():
        sum_across_ranks(total)
    tokens = int(sum_across_ranks(torch.tensor([tokens], dtype=torch.float64)).item())
    mean = {name: total / max(tokens, 1) for name, total in grads.items()}
    divides = shared_columns({name: shape_of(module)[1] for name, module in modules.items()})  # an expert's: its block's
    costs: dict[str, list[float]] = {}
    input_of: dict[str, str] = {}
    _weigh(modules, [n for n in modules if n not in inside], outside_hessians, mean, options, rounding, costs, input_of, divides)
    del outside_hessians
    release_free_memory()  # the rows' graphs go back before the blocks' Hessians come
    if first_inputs is not None:
        _block_by_block(blocks, modules, inside, first_inputs, arguments, mean, options, rounding, costs, input_of, divides)
    table: dict[str, list[float]] = {}
    for part in gather_objects(costs):  # in rank order: the shares of split modules added up, the others as weighed
        for name, values in part.items():
            table[name] = values if name not in table else [a + b for a, b in zip(table[name], values, strict=True)]
    return Measured({name: table[name] for name in modules}, input_of, grads, tokens)


def _backward_pass(model: nn.Module, modules: dict[str, nn.Module], rows: list[torch.Tensor], hessians_of: list[str],
                   blocks: nn.ModuleList | None, first_inputs: list[tuple[tuple, dict]] | None
                   ) -> tuple[HessianCollector, dict[str, torch.Tensor], int, BlockArguments | None]:
    """One forward and backward a row: the squared output gradients of every module, the input
    Hessians of ``hessians_of``, and (``first_inputs``) what each row gives the first block and
    what the other blocks get besides their hidden states where it is not the first one's."""
    collector = HessianCollector()
    grads = {name: torch.zeros(linear_weight(m.weight, m).shape[0], dtype=torch.float64, device=m.weight.device)
             for name, m in modules.items()}
    starts: list[torch.Tensor] = []
    weighed_here = set(hessians_of)

    def watch(name: str):
        def hook(_module: nn.Module, args: tuple, output: Any) -> None:
            if name in weighed_here:
                collector.add(name, args[0])
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(squared_into(grads[name]))
        return hook

    def squared_into(total: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:  # returns nothing: the gradient goes on as it is
            total.add_(grad.reshape(-1, grad.shape[-1]).double().square().sum(0))
        return hook

    def start_graph(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        starts.append(output.detach().requires_grad_(True))  # the gradients asked for: no weight's
        return starts[-1]

    def keep_first(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        first_inputs.append(with_primary_input(args, kwargs, primary_input(args, kwargs).detach().clone()))

    def note(index: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            arguments.note(index, kwargs, primary_input(args, kwargs))
        return hook

    handles = [module.register_forward_hook(watch(name)) for name, module in modules.items()]
    handles.append(model.get_input_embeddings().register_forward_hook(start_graph))
    arguments = BlockArguments(len(blocks)) if first_inputs is not None else None
    if first_inputs is not None:
        handles.append(blocks[0].register_forward_pre_hook(keep_first, with_kwargs=True))
        handles += [block.register_forward_pre_hook(note(i), with_kwargs=True) for i, block in enumerate(blocks)]
    device = next(iter(modules.values())).weight.device
    tokens = 0
    try:
        with (torch.enable_grad(), _recomputed(blocks),
              tqdm(rows, desc="Measuring sensitivity", unit="seq", leave=False, disable=not is_main_process()) as bar):
            for ids in bar:
                ids = ids.reshape(1, -1).to(device)
                output = model(input_ids=ids, use_cache=False)  # the blocks run again on kept inputs: no cache of these keys
                logits = output.logits if hasattr(output, "logits") else output[0]
                loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                torch.autograd.grad(loss, starts)  # through every module's output, firing their hooks
                starts.clear()
                collector.end_of_first_pass()
                tokens += ids.shape[1]
    finally:
        for handle in handles:
            handle.remove()
        collector.end_of_first_pass()
    return collector, grads, tokens, None if arguments is None else arguments.kept()


@torch.no_grad()
def _block_by_block(blocks: nn.ModuleList, modules: dict[str, nn.Module], inside: list[str], inputs: list[tuple[tuple, dict]],
                    arguments: BlockArguments | None, grads: dict[str, torch.Tensor], options: list[MenuOption],
                    rounding: Rounding, costs: dict[str, list[float]], input_of: dict[str, str], divides: dict[str, int]) -> None:
    """Each block on every row's inputs (with its own other arguments: ``arguments``), its
    modules' Hessians summed and weighed, then freed; the block's outputs become the next block's
    inputs, up to the last block with a module to weigh."""
    of_module = {modules[name]: name for name in inside}
    names_by_block = [[of_module[m] for m in block.modules() if m in of_module] for block in blocks]
    last = max(i for i, names in enumerate(names_by_block) if names)
    with tqdm(total=last + 1, desc="Weighing layers", unit="layer", leave=False, disable=not is_main_process()) as bar:
        for index, block in enumerate(blocks):
            if index > last:
                break
            names = names_by_block[index]
            if arguments is not None:
                arguments.adopt(inputs, index)
            collector = HessianCollector()
            handles = [modules[name].register_forward_hook(_feeding(collector, name)) for name in names]
            try:
                for row, (args, kwargs) in enumerate(inputs):
                    output = block(*args, **kwargs)
                    collector.end_of_first_pass()
                    if index < last:
                        inputs[row] = with_primary_input(args, kwargs, hidden_of(output))
            finally:
                for handle in handles:
                    handle.remove()
            _weigh(modules, names, collector, grads, options, rounding, costs, input_of, divides)
            del collector
            release_free_memory()  # the block's Hessians and solver temporaries go back
            bar.update()
    inputs.clear()


@contextmanager
def _recomputed(blocks: nn.ModuleList | None) -> Iterator[None]:
    """Within, each block keeps only its inputs for the backward pass and runs again to give it
    what else it needs (``torch.utils.checkpoint``): a row's graph holds one block's activations,
    not every block's (at 2048 tokens, ~350 MB a Llama-3-8B layer in bf16; 11 GB for 32). The
    values and gradients are the same; the forward runs twice. The block's own hooks run once
    (its ``forward`` is what runs again); its modules' run again as far as the backward pass needs
    the block's values, outside the graph the gradients flow through (what they add to it is
    never reached: the gradients are read once, on the first run's outputs)."""
    if blocks is None:
        yield
        return
    before = [block.__dict__.get("forward") for block in blocks]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    try:
        yield
    finally:
        for block, forward in zip(blocks, before, strict=True):
            if forward is None:
                del block.forward
            else:
                block.forward = forward


def _feeding(collector: HessianCollector, name: str):
    def hook(_module: nn.Module, args: tuple, _output: Any) -> None:
        collector.add(name, args[0])
    return hook


def _weigh(modules: dict[str, nn.Module], names: list[str], collector: HessianCollector, grads: dict[str, torch.Tensor],
           options: list[MenuOption], rounding: Rounding, costs: dict[str, list[float]], input_of: dict[str, str],
           divides: dict[str, int]) -> None:
    """The costs of ``names`` from ``collector``'s Hessians, into ``costs`` (each module's groups
    made to divide its width in ``divides``); their accumulators are freed. Collective. Under
    torch.distributed a Hessian whose options all round row by row (groups, channels: GPTQ and
    round-to-nearest treat each row on its own) goes to every rank,
    each weighing its share of every module's rows (``costs`` then holds that share's sum, which
    ``measure`` adds up over the ranks); any other goes whole to one rank (the largest solves
    first to the least loaded)."""
    if not names:
        return
    collector.agree(names, next(iter(modules[n] for n in names)).weight.device)  # an expert one rank's tokens never reached
    accumulators = list({id(a): a for n in names if (a := collector.of_module.get(n)) is not None}.values())
    by_rows = world_size() > 1 and _row_wise(options)
    owners = assign_owners([0.0 if by_rows else a.columns ** 2 * (a.columns + sum(shape_of(modules[n])[0] for n in a.members))
                            for a in accumulators])
    node = node_team() if by_rows and accumulators else None  # ranks on one machine sum the shared Hessians in memory they share
    for accumulator, owner in zip(accumulators, owners, strict=True):
        accumulator.reduce(None if by_rows else owner, node=node)
        if by_rows or owner == rank():
            hessian = _sum_of_products(accumulator)
            for member in accumulator.members:
                share = _row_share(shape_of(modules[member])[0]) if by_rows else None
                costs[member] = option_costs(modules[member], hessian, grads[member], options, rounding, share, divides[member])
            del hessian
        input_of.update({member: accumulator.members[0] for member in accumulator.members})
    if rank() == 0:  # a module no token reached on any rank: no Hessian, no cost
        costs.update({n: option_costs(modules[n], None, grads[n], options, rounding) for n in names if n not in collector.of_module})
    collector.release(names)


def _sum_of_products(accumulator: HessianAccumulator) -> torch.Tensor:
    """The Hessian ``X^T X`` (the accumulator's ``2/n X^T X`` scaled back), in place: by one rank
    where the ranks share it in memory (``HessianAccumulator.reduce`` with a node), the others
    waiting until it is done."""
    hessian, shared = accumulator.result(), accumulator.node
    if shared is None or shared.rank == 0:
        hessian.mul_(accumulator.samples / 2)
    if shared is not None:
        shared.sync()
    return hessian


def _row_wise(options: list[MenuOption]) -> bool:
    """Whether every option rounds a weight row by row (qparams by group or channel, no scale
    over the whole tensor): the rounding of a share of the rows is then those rows' rounding."""
    return all(o.scheme is None or o.scheme.weights is None or o.scheme.weights.strategy in ("group", "channel") for o in options)


def _row_share(rows: int) -> tuple[int, int]:
    """This rank's rows of ``rows``, in rank order."""
    return rows * rank() // world_size(), rows * (rank() + 1) // world_size()
