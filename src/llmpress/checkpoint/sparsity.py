"""The ``sparsity_config`` of a pruned model, in compressed-tensors' JSON.

Pruning modifiers mark each module they prune with its structure (``SPARSITY_ATTR``); the save
path describes those modules here. Weights are stored dense (zeros included), the ``dense``
sparsity format that compressed-tensors, transformers and vLLM read; the config records which
modules are sparse, how, and how sparse they are, so a serving engine can pick sparse kernels.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmpress.integrations.fsdp import whole
from llmpress.models.linear import is_linear, linear_weight

__all__ = ["SPARSITY_ATTR", "SPARSITY_KEY", "mark_sparse_modules", "sparsity_config_for", "sparsity_of", "structure_of"]

# attribute on a pruned module: "unstructured" or "N:M"
SPARSITY_ATTR = "llmpress_sparsity_structure"
#: config.json key of a pruned, unquantized checkpoint's sparsity record (it has no quantization_config)
SPARSITY_KEY = "llmpress_sparsity"


def _weight(module: nn.Module):
    """The weight as ``[out, in]`` (N:M runs along the inputs), or None."""
    weight = getattr(module, "weight", None)
    if weight is None and hasattr(module, "dequantized_weight"):  # a runtime QuantizedLinear
        weight = module.dequantized_weight()
    return None if weight is None else linear_weight(whole(weight), module)  # FSDP: the whole weight (a collective)


def sparsity_of(module: nn.Module) -> float:
    """The fraction of the module's weight that is exactly zero."""
    weight = _weight(module)
    return float((weight == 0).sum()) / max(weight.numel(), 1)


def structure_of(keep) -> str:
    """``"2:4"`` when at most 2 of every 4 consecutive inputs are kept, else ``"unstructured"``."""
    return "2:4" if _keeps(keep, "2:4") else "unstructured"


def _keeps(keep, structure: str) -> bool:
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
    from llmpress.targets import assign_by_targets

    structure = sparsity_config.get("sparsity_structure") or "unstructured"
    chosen = assign_by_targets(model, [(list(sparsity_config["targets"]), None)], sparsity_config.get("ignore") or [])
    for module, _ in chosen.values():
        if _weight(module) is not None:
            setattr(module, SPARSITY_ATTR, structure)


def sparsity_config_for(model: nn.Module) -> dict[str, Any] | None:
    """``{"format": "dense", "sparsity_structure", "global_sparsity", "targets", "ignore"}`` when
    some module was pruned, else None."""
    pruned = [(n, m) for n, m in model.named_modules() if getattr(m, SPARSITY_ATTR, None)]
    if not pruned:
        return None
    keeps = [_weight(m) != 0 for _, m in pruned]
    # N:M only when every pruned module's zeros really are its N:M (mid-schedule they are not yet)
    structures = {getattr(m, SPARSITY_ATTR) for _, m in pruned}
    if any(not _keeps(keep, getattr(m, SPARSITY_ATTR)) for (_, m), keep in zip(pruned, keeps)):
        structures = {"unstructured"}
    total = sum(keep.numel() for keep in keeps)
    zeros = total - sum(int(keep.sum()) for keep in keeps)
    names = {n for n, _ in pruned}
    linear = [n for n, m in model.named_modules() if is_linear(m)]
    return {
        "format": "dense",
        "sparsity_structure": structures.pop() if len(structures) == 1 else "unstructured",
        "global_sparsity": round(zeros / max(total, 1), 6),
        "targets": sorted(names),
        "ignore": [n for n in linear if n not in names],
        "registry_requires_subclass": False,
    }
