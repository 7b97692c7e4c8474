"""FSDP2 (``torch.distributed.fsdp.fully_shard``): what llmpress needs of a sharded model.

Outside its forward and backward, a ``fully_shard``-ed module holds each parameter as a
``DTensor``: every rank keeps its own rows. The training modifiers act on those shards (a
pruning mask is applied shard by shard, multiplying local rows), but decide on the whole tensor:
``whole`` gathers a weight so that a mask keeps the global share of weights (50% of the
Linear, not 50% of each rank's rows), and ``like`` cuts the whole-tensor result back into the
shard's placement, without communication (every rank computed the same whole result).

``unwrap_if_fsdp`` is what the one save path uses: it gathers the full parameters on the main
rank, on the CPU, puts them in the modules for the length of the save, and gives the sharded
model back afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from llmpress.parallel.distributed import is_main_process

__all__ = ["is_dtensor", "is_sharded", "like", "unwrap_if_fsdp", "whole"]


def _dtensor_type() -> type | None:
    """``DTensor``, once ``torch.distributed.tensor`` is imported: no tensor can be one before,
    and importing it for the question would cost 0.4 s of every run."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(tensor: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered: every rank must call), else ``tensor``."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor, the same on every rank) laid out as ``reference``: its local
    shard when ``reference`` is a DTensor (no communication), else itself."""
    if not is_dtensor(reference):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(reference.device), reference.device_mesh, reference.placements, src_data_rank=None)


@contextmanager
def unwrap_if_fsdp(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> Iterator[nn.Module]:
    """``model`` with whole parameters on the main rank for the length of the block (a save), the
    sharded ones back afterwards; ``model`` as it is when nothing is sharded.

    Without ``state_dict`` it gathers them (a collective: every rank enters); with one (a
    Trainer's gathered state dict, on the main rank), it takes them from there."""
    if not is_sharded(model):
        yield model
        return
    if state_dict is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    if is_main_process():
        by_parameter: dict[int, torch.Tensor] = {}
        for name, param in model.named_parameters(remove_duplicate=False):  # a tied weight under either name
            if name in state_dict:
                by_parameter.setdefault(id(param), state_dict[name])
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if is_dtensor(param) and id(param) in by_parameter:
                    module.register_parameter(name, nn.Parameter(by_parameter[id(param)].detach(), requires_grad=False))
                    swapped.append((module, name, param))
    try:
        yield model
    finally:
        for module, name, param in swapped:
            module.register_parameter(name, param)
