"""Which modules are pruned, and how: the mark a pruning modifier (or a loaded sparse
checkpoint) leaves on a module, and what its weight's zeros look like.

Pruning modifiers mark each module they prune with its structure (``"unstructured"`` or
``"N:M"``, ``mark_sparse``: the ``sparsity`` of its state); GPTQ keeps a marked module's zeros,
and the save path describes the marked modules in the checkpoint's ``sparsity_config``
(``checkpoint/sparsity.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmpress.lifecycle.state import existing_state, state_of
from llmpress.models.linear import linear_weight
from llmpress.parallel.fsdp import whole
from llmpress.targets import assign_by_targets

__all__ = ["keeps_structure", "mark_sparse", "mark_sparse_modules", "module_weight", "sparsity_of", "sparsity_structure", "structure_of"]


def mark_sparse(module: nn.Module, structure: str) -> None:
    """``module`` is pruned, ``"unstructured"`` or ``"N:M"``."""
    state_of(module).sparsity = structure


def sparsity_structure(module: nn.Module) -> str | None:
    """How ``module`` was pruned (``"unstructured"``, ``"N:M"``), or None when it was not."""
    state = existing_state(module)
    return None if state is None else state.sparsity


def module_weight(module: nn.Module):
    """The weight as ``[out, in]`` (N:M runs along the inputs), or None."""
    weight = getattr(module, "weight", None)
    if weight is None and hasattr(module, "dequantized_weight"):  # a runtime QuantizedLinear
        weight = module.dequantized_weight()
    return None if weight is None else linear_weight(whole(weight), module)  # FSDP: the whole weight (a collective)


def sparsity_of(module: nn.Module) -> float:
    """The fraction of the module's weight that is exactly zero."""
    weight = module_weight(module)
    return float((weight == 0).sum()) / max(weight.numel(), 1)


def structure_of(keep) -> str:
    """``"2:4"`` when at most 2 of every 4 consecutive inputs are kept, else ``"unstructured"``."""
    return "2:4" if keeps_structure(keep, "2:4") else "unstructured"


def keeps_structure(keep, structure: str) -> bool:
    """Whether the keep-mask has at most N of every M consecutive inputs (``structure`` "N:M")."""
    if structure == "unstructured":
        return True
    n, m = (int(x) for x in structure.split(":"))
    return keep.shape[-1] % m == 0 and bool((keep.reshape(-1, m).sum(dim=1) <= n).all())


def mark_sparse_modules(model: nn.Module, sparsity_config: dict[str, Any] | None) -> None:
    """Mark the modules a loaded checkpoint's ``sparsity_config`` names, so saving the model
    again describes them again."""
    if not sparsity_config or not sparsity_config.get("targets"):
        return
    structure = sparsity_config.get("sparsity_structure") or "unstructured"
    chosen = assign_by_targets(model, [(list(sparsity_config["targets"]), None)], sparsity_config.get("ignore") or [])
    for module, _ in chosen.values():
        if module_weight(module) is not None:
            mark_sparse(module, structure)
