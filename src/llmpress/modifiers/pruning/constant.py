"""``ConstantPruningModifier``: weights that are zero stay zero through training.

For fine-tuning a model that is already sparse (after SparseGPT, Wanda or magnitude pruning):
the zeros found at ``initialize`` are re-applied after every optimizer step inside the window
and once more at ``finalize``::

    ConstantPruningModifier:
      targets: ['re:.*proj$']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.contract.modifier import MODIFIERS, Modifier, State, WindowFields
from llmpress.lifecycle.sparsity import mark_sparse, sparsity_of, structure_of
from llmpress.models.linear import linear_weight
from llmpress.modifiers.pruning.masks import prunable_modules
from llmpress.parallel.fsdp import like, whole

__all__ = ["ConstantPruningModifier"]


class ConstantPruningConfig(WindowFields):
    targets: list[str] = ["Linear"]
    ignore: list[str] = ["lm_head"]

    def llm_compressor_requires(self) -> dict[str, Any]:
        return {"targets": list(self.targets)}


@MODIFIERS.register("ConstantPruningModifier")
class ConstantPruningModifier(Modifier):
    Config = ConstantPruningConfig

    def on_initialize(self, state: State) -> None:
        modules = prunable_modules(state.model, self.config.targets, self.config.ignore, type(self).__name__)
        self.masks: dict[str, tuple[nn.Module, torch.Tensor]] = {}
        for name, module in modules.items():
            mask = whole(module.weight.detach()) != 0  # FSDP: decided on the whole weight, the same on every rank
            if not bool(mask.all()):  # only modules that are sparse have zeros to keep
                self.masks[name] = (module, like(mask, module.weight))  # applied to this rank's shard
                mark_sparse(module, structure_of(linear_weight(mask, module)))

    def on_optim_post_step(self, state: State) -> None:
        self.apply()

    def on_finalize(self, state: State) -> None:
        self.apply()
        self.masks.clear()

    @torch.no_grad()
    def apply(self) -> None:
        for module, mask in self.masks.values():
            module.weight.mul_(mask)

    def sparsity(self) -> dict[str, float]:
        """Zeros per masked module, as a fraction of its weights."""
        return {n: sparsity_of(m) for n, (m, _) in self.masks.items()}
