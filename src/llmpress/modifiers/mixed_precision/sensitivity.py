"""How much rounding each module's weight costs the model's loss, and which modules must share a
scheme.

The cost of moving a weight by ``dW`` is about ``1/2 sum F * dW^2`` (a second-order expansion of
the loss, its Hessian taken as the diagonal of the empirical Fisher information: the squared
gradient of each calibration token's next-token loss, summed over tokens). That puts every
module, at any depth, in the loss's own units, which a module's output error alone does not.
Each menu scheme's ``dW`` is its round-to-nearest error; GPTQ and AWQ lower every module's
error, but the order of the modules' costs is what the choice needs.

What the costs are measured from, in memory bounded by one layer: ``measure.py``.

Modules that read the same input (q/k/v, gate/up) are served as one fused layer by vLLM, which
takes one scheme per layer, and so are the experts of one mixture-of-experts block: each such set
is one group here, with one scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmpress.errors import DataError
from llmpress.models.linear import features, linear_weight
from llmpress.modifiers.mixed_precision.menu import MenuOption
from llmpress.parallel.distributed import gather_objects, is_distributed
from llmpress.quant.groups import EXPERT_NAME, fitted_weight_group
from llmpress.quant.observers import fake_quantize_weight
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["Rounding", "module_groups", "option_costs", "round_to_nearest", "sequences", "shape_of"]

#: the group key of every expert of the model under ``experts="shared"`` (no module name has a space)
_ALL_EXPERTS = " experts"


def sequences(calibration_data: Any, samples: int) -> list[torch.Tensor]:
    """The first ``samples`` token-id sequences of the calibration data (tensors, lists of them,
    batches of them, or dicts with ``input_ids``). Under torch.distributed, where each rank holds
    every ``world_size``-th batch (``share_of``), they are the first ``samples`` of one process's
    batches, the same on every rank (``measure.py`` takes each rank's share)."""
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


#: ``(weight [out, in] float32, its inputs' Hessian, scheme) -> the weight as the algorithm rounds it``
Rounding = Callable[[torch.Tensor, torch.Tensor, QuantizationScheme], torch.Tensor]


def round_to_nearest(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    return fake_quantize_weight(weight, scheme.weights).float()


def option_costs(module: nn.Module, hessian: torch.Tensor | None, grads: torch.Tensor, options: list[MenuOption],
                 rounding: Rounding = round_to_nearest, rows: tuple[int, int] | None = None, divides: int | None = None) -> list[float]:
    """``module``'s cost under each option: for the option's rounding error ``dW`` (made by
    ``rounding``, the algorithm that will round the weight), ``1/2 sum_i g_i dW_i H dW_i^T``,
    ``g_i`` the mean squared output gradient of row ``i`` (``grads``) and ``H`` the inputs'
    Hessian ``sum_t x_t x_t^T``: the loss's second-order rise with its Fisher information factored
    into outputs and inputs. The whole ``H`` sees what GPTQ does (it moves each rounding error
    where the inputs make it cheap). Zero for an option that leaves the weight as it is, and for
    a module no token reached (``hessian`` None). ``rows``: only the rows ``start:end`` (where
    each row rounds on its own), their part of the sum. ``divides``: the width the option's groups
    must divide where not the weight's own (an expert's: its block's, ``shared_columns``)."""
    weight = linear_weight(module.weight.detach(), module).float()
    if rows is not None:
        weight, grads = weight[rows[0] : rows[1]], grads[rows[0] : rows[1]]
    costs = []
    for option in options:
        if option.scheme is None or option.scheme.weights is None or hessian is None:
            costs.append(0.0)
            continue
        error = rounding(weight, hessian, fitted_weight_group(option.scheme, divides or weight.shape[1])) - weight
        row_costs = ((error @ hessian) * error).sum(1)
        costs.append(0.5 * float((grads.to(row_costs) * row_costs).sum(dtype=torch.float64)))
    return costs


def module_groups(modules: dict[str, nn.Module], input_of: dict[str, str], experts: str = "shared") -> list[list[str]]:
    """``modules`` in groups that take one scheme, in the model's order: those that read the
    same input tensor (``input_of``: each module's first reader of its input), and the experts'
    modules: of every experts block (``experts="shared"``: transformers 5 reads one scheme for
    all of a model's experts), or of each block (``"per_block"``: vLLM serves a block as one
    layer, of one scheme)."""
    key: dict[str, str] = {}
    for name in modules:
        found = EXPERT_NAME.fullmatch(name)
        key[name] = (_ALL_EXPERTS if experts == "shared" else found.group(1)) if found else input_of.get(name, name)
    groups: dict[str, list[str]] = {}
    for name in modules:
        groups.setdefault(key[name], []).append(name)
    return list(groups.values())


def shape_of(module: nn.Module) -> tuple[int, int]:
    """``(rows, columns)`` of a linear module's weight as ``[out, in]``."""
    columns, rows = features(module)
    return rows, columns
