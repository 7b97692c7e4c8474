"""The ``sparsity_config`` of a pruned model, in compressed-tensors' JSON.

Pruning modifiers mark each module they prune with its structure (``SPARSITY_ATTR``); the save
path describes those modules here. Weights are stored dense (zeros included), the ``dense``
sparsity format that compressed-tensors, transformers and vLLM read; the config records which
modules are sparse, how, and how sparse they are, so a serving engine can pick sparse kernels.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["SPARSITY_ATTR", "sparsity_config_for", "sparsity_of"]

# attribute on a pruned module: "unstructured" or "N:M"
SPARSITY_ATTR = "llmpress_sparsity_structure"


def sparsity_of(module: nn.Module) -> float:
    """The fraction of the module's weight that is exactly zero."""
    weight = module.weight
    return float((weight == 0).sum()) / max(weight.numel(), 1)


def sparsity_config_for(model: nn.Module) -> dict[str, Any] | None:
    """``{"format": "dense", "sparsity_structure", "global_sparsity", "targets", "ignore"}`` when
    some module was pruned, else None."""
    pruned = [(n, m) for n, m in model.named_modules() if getattr(m, SPARSITY_ATTR, None)]
    if not pruned:
        return None
    structures = {getattr(m, SPARSITY_ATTR) for _, m in pruned}
    zeros = sum(float((m.weight == 0).sum()) for _, m in pruned)
    total = sum(m.weight.numel() for _, m in pruned)
    names = {n for n, _ in pruned}
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {
        "format": "dense",
        "sparsity_structure": structures.pop() if len(structures) == 1 else "unstructured",
        "global_sparsity": round(zeros / max(total, 1), 6),
        "targets": sorted(names),
        "ignore": [n for n in linear if n not in names],
        "registry_requires_subclass": False,
    }
