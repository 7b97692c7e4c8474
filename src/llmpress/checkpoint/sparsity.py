"""The ``sparsity_config`` of a pruned model, in compressed-tensors' JSON.

Pruning modifiers mark each module they prune with its structure (``lifecycle/sparsity.py``);
the save path describes those modules here. Weights are stored dense (zeros included), the
``dense`` sparsity format that compressed-tensors, transformers and vLLM read; the config records
which modules are sparse, how, and how sparse they are, so a serving engine can pick sparse
kernels.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmpress.lifecycle.records import held_weights
from llmpress.lifecycle.sparsity import keeps_structure, module_weight, sparsity_structure
from llmpress.models.linear import is_linear, linear_weight

__all__ = ["SPARSITY_KEY", "sparsity_config_for"]

#: config.json key of a pruned, unquantized checkpoint's sparsity record (it has no quantization_config)
SPARSITY_KEY = "llmpress_sparsity"


def sparsity_config_for(model: nn.Module) -> dict[str, Any] | None:
    """``{"format": "dense", "sparsity_structure", "global_sparsity", "targets", "ignore"}`` when
    some module was pruned, else None. Read one module at a time; a finished layer held as
    integers (``pipelines/storage/compact.py``) is looked at without letting its integers go."""
    pruned = [(n, m) for n, m in model.named_modules() if sparsity_structure(m)]
    if not pruned:
        return None
    held = held_weights(model)
    structures = {sparsity_structure(m) for _, m in pruned}
    total = zeros = 0
    for _, module in pruned:
        weight = held.weight_of(module, release=False) if held is not None and module.weight.is_meta else None
        keep = (module_weight(module) if weight is None else linear_weight(weight, module)) != 0
        # N:M only when every pruned module's zeros really are its N:M (mid-schedule they are not yet)
        if not keeps_structure(keep, sparsity_structure(module)):
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
