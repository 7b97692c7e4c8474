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
    some module was pruned, else None. Read one module at a time; a finished layer held as
    integers (``quant/compact.py``) is looked at without letting its integers go."""
    from llmpress.quant.compact import held_weights

    pruned = [(n, m) for n, m in model.named_modules() if getattr(m, SPARSITY_ATTR, None)]
    if not pruned:
        return None
    held = held_weights(model)
    structures = {getattr(m, SPARSITY_ATTR) for _, m in pruned}
    total = zeros = 0
    for _, module in pruned:
        weight = held.weight_of(module, release=False) if held is not None and module.weight.is_meta else None
        keep = (_weight(module) if weight is None else linear_weight(weight, module)) != 0
        # N:M only when every pruned module's zeros really are its N:M (mid-schedule they are not yet)
        if not _keeps(keep, getattr(module, SPARSITY_ATTR)):
            structures = {"unstructured"}
        total += keep.numel()
        zeros += keep.numel() - int(keep.sum())
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
