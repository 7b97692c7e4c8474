"""How much rounding each module's weight costs the model's loss, and which modules must share a
scheme.

The cost of moving a weight by ``dW`` is about ``1/2 sum F * dW^2`` (a second-order expansion of
the loss, its Hessian taken as the diagonal of the empirical Fisher information: the squared
gradient of each calibration token's next-token loss, summed over tokens). That puts every
module, at any depth, in the loss's own units, which a module's output error alone does not.
Each menu scheme's ``dW`` is its round-to-nearest error; GPTQ and AWQ lower every module's
error, but the order of the modules' costs is what the choice needs.

Modules that read the same input (q/k/v, gate/up) are served as one fused layer by vLLM, which
takes one scheme per layer, and so are the experts of one mixture-of-experts block: each such set
is one group here, with one scheme.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import DataError
from llmpress.models.linear import features, linear_weight
from llmpress.modifiers.hessians import HessianCollector
from llmpress.modifiers.mixed_precision.menu import MenuOption
from llmpress.parallel.distributed import (
    assign_owners,
    gather_objects,
    is_distributed,
    is_main_process,
    rank,
    sum_across_ranks,
    world_size,
)
from llmpress.quant.groups import fitted_weight_group
from llmpress.quant.observers import fake_quantize_weight
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["EXPERT_NAME", "Rounding", "Statistics", "gather_statistics", "module_groups", "round_to_nearest", "sensitivities", "sequences"]

#: an expert's module: (its experts block, its own name in the expert)
EXPERT_NAME = re.compile(r"(.*\.experts)\.\d+\.(.+)")


def sequences(calibration_data: Any, samples: int) -> list[torch.Tensor]:
    """The first ``samples`` token-id sequences of the calibration data (tensors, lists of them,
    batches of them, or dicts with ``input_ids``). Under torch.distributed, where each rank holds
    every ``world_size``-th batch (``share_of``), they are the first ``samples`` of one process's
    batches, the same on every rank (``gather_statistics`` takes each rank's share)."""
    batches: list[list[torch.Tensor]] = []
    held = 0
    for batch in calibration_data or []:
        if held >= samples:  # a later batch, on any rank, comes after these in one process's order
            break
        ids = batch.get("input_ids") if isinstance(batch, dict) else batch
        ids = torch.as_tensor(ids)
        batches.append(list(ids) if ids.dim() == 2 else [ids])
        held += len(batches[-1])
    if is_distributed():  # every rank's first batches, back in one process's order
        shares = gather_objects(batches)
        batches = [shares[g % len(shares)][g // len(shares)] for g in range(sum(len(s) for s in shares))]
    rows = [r for b in batches for r in b][:samples]
    rows = [r for r in rows if r.numel() >= 2]
    if not rows:
        raise DataError("mixed precision measures each module's sensitivity on calibration data, and there is none",
                        got="no calibration sequence of 2 tokens or more",
                        expected="calibration_data: token-id sequences", fix="pass a dataset (llmpress oneshot --dataset ...)")
    return rows


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


@dataclass
class Statistics:
    """What the loss says of each module on the calibration tokens: the Hessian of its inputs
    ``sum_t x_t x_t^T`` (one tensor shared by the modules that read the same input), the squared
    gradient of each token's loss at each of its outputs ``sum_t (dL_t/dy_t)^2``, and the count
    of tokens. Under torch.distributed each rank weighs the modules it owns (``owner``), and
    holds only their Hessians."""

    hessians: dict[str, torch.Tensor]
    output_grads: dict[str, torch.Tensor]
    tokens: int
    input_of: dict[str, str]  # module -> the first module that read the same input in a forward
    owner: dict[str, int]  # module -> the rank that weighs its options (0 in one process)


def gather_statistics(model: nn.Module, modules: dict[str, nn.Module], rows: list[torch.Tensor]) -> Statistics:
    """``Statistics`` of ``modules`` over ``rows`` (one forward and backward a row; no weight
    gradient is computed and the model is left as it was). Under torch.distributed each rank
    runs every ``world_size``-th row and the sums are taken over the ranks, each Hessian onto the
    one rank that will weigh its modules' options. The Hessians are GPTQ's (``HessianCollector``:
    one per distinct input, float64 sums of per-sequence products), brought back to
    ``sum_t x_t x_t^T``."""
    collector = HessianCollector()
    grads = {name: torch.zeros(linear_weight(m.weight, m).shape[0], dtype=torch.float64, device=m.weight.device)
             for name, m in modules.items()}
    starts: list[torch.Tensor] = []

    def watch(name: str):
        def hook(_module: nn.Module, args: tuple, output: Any) -> None:
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

    handles = [module.register_forward_hook(watch(name)) for name, module in modules.items()]
    handles.append(model.get_input_embeddings().register_forward_hook(start_graph))
    device = next(iter(modules.values())).weight.device
    rows = rows[rank()::world_size()]
    tokens = 0
    try:
        with torch.enable_grad():
            for ids in tqdm(rows, desc="Measuring sensitivity", unit="seq", leave=False, disable=not is_main_process()):
                ids = ids.reshape(1, -1).to(device)
                logits = _logits(model(input_ids=ids))
                loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                torch.autograd.grad(loss, starts)  # through every module's output, firing their hooks
                starts.clear()
                collector.end_of_first_pass()
                tokens += ids.shape[1]
    finally:
        for handle in handles:
            handle.remove()
        collector.end_of_first_pass()
    collector.agree(list(modules), device)  # an expert one rank's tokens never reached: zeros there
    of_module = collector.of_module
    accumulators = list({id(a): a for a in of_module.values()}.values())
    # the modules of one input go to one rank (one factor for all their options), the largest
    # solves first to the least loaded rank: a factor, then a solve per option and member
    owners = assign_owners([a.columns ** 2 * (a.columns + sum(shape_of(modules[n])[0] for n in a.members)) for a in accumulators])
    hessians: dict[int, torch.Tensor] = {}
    for accumulator, owner in zip(accumulators, owners):
        accumulator.reduce(owner)
        if owner == rank():
            hessians[id(accumulator)] = accumulator.result().mul_(accumulator.samples / 2)  # 2/n X^T X back to X^T X
    for total in grads.values():
        sum_across_ranks(total)
    tokens = int(sum_across_ranks(torch.tensor([tokens], dtype=torch.float64)).item())
    owner_of = {id(a): owner for a, owner in zip(accumulators, owners)}
    return Statistics({n: hessians[id(a)] for n, a in of_module.items() if id(a) in hessians}, grads, tokens,
                      {n: a.members[0] for n, a in of_module.items()}, {n: owner_of[id(a)] for n, a in of_module.items()})


#: ``(weight [out, in] float32, its inputs' Hessian, scheme) -> the weight as the algorithm rounds it``
Rounding = Callable[[torch.Tensor, torch.Tensor, QuantizationScheme], torch.Tensor]


def round_to_nearest(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    return fake_quantize_weight(weight, scheme.weights).float()


def sensitivities(modules: dict[str, nn.Module], stats: Statistics, options: list[MenuOption],
                  rounding: Rounding = round_to_nearest) -> dict[str, list[float]]:
    """``{module: [cost per option]}``: for the option's rounding error ``dW`` (made by
    ``rounding``, the algorithm that will round the weight), ``1/2 sum_i g_i dW_i H dW_i^T``,
    ``g_i`` the mean squared output gradient of row ``i`` and ``H`` the inputs' Hessian: the
    loss's second-order rise with its Fisher information factored into outputs and inputs. The
    whole ``H`` sees what GPTQ does (it moves each rounding error where the inputs make it
    cheap). Zero for an option that leaves the weight as it is. Each rank weighs the modules it
    owns (``stats.owner``), and every rank gets the whole table."""
    table: dict[str, list[float]] = {}
    for name, module in modules.items():
        if stats.owner.get(name, 0) != rank():
            continue
        weight = linear_weight(module.weight.detach(), module).float()
        hessian = stats.hessians.get(name)
        grads = (stats.output_grads[name] / max(stats.tokens, 1)).float()
        costs = []
        for option in options:
            if option.scheme is None or option.scheme.weights is None or hessian is None:
                costs.append(0.0)
                continue
            error = rounding(weight, hessian, fitted_weight_group(option.scheme, weight.shape[1])) - weight
            costs.append(0.5 * float((grads * ((error @ hessian) * error).sum(1)).sum(dtype=torch.float64)))
        table[name] = costs
    weighed = {name: costs for part in gather_objects(table) for name, costs in part.items()}
    return {name: weighed[name] for name in modules}


def module_groups(modules: dict[str, nn.Module], stats: Statistics) -> list[list[str]]:
    """``modules`` in groups that take one scheme, in the model's order: those that read the
    same input tensor (``stats.input_of``), and every expert's modules of one experts block."""
    key: dict[str, str] = {}
    for name in modules:
        found = EXPERT_NAME.fullmatch(name)
        key[name] = found.group(1) if found else stats.input_of.get(name, name)
    groups: dict[str, list[str]] = {}
    for name in modules:
        groups.setdefault(key[name], []).append(name)
    return list(groups.values())


def shape_of(module: nn.Module) -> tuple[int, int]:
    """``(rows, columns)`` of a linear module's weight as ``[out, in]``."""
    columns, rows = features(module)
    return rows, columns
