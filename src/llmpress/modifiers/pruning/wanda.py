"""``WandaPruningModifier``: one-shot pruning by weight and activation (Sun et al., 2023),
llm-compressor's fields and meaning::

    sparsity_stage:
      sparsity_modifiers:
        WandaPruningModifier:
          sparsity: 0.5
          mask_structure: "0:0"
          ignore: ["re:.*lm_head"]

Each weight scores ``|W_ij| * ||x_j||``, the norm of its input over the calibration tokens. In
every row the lowest scores are pruned: ``sparsity`` of the row, or N of every M inputs with
``mask_structure: "N:M"``. Nothing else changes: no weight update, one pass, no Hessian.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.contract.modifier import MODIFIERS
from llmpress.models.linear import linear_weight
from llmpress.modifiers.pruning.oneshot import (
    OneShotPruningConfig,
    OneShotPruningModifier,
    column_squares,
    column_squares_over_ranks,
)
from llmpress.parallel.distributed import is_distributed

__all__ = ["WandaPruningModifier", "wanda_mask"]


class WandaPruningModifierConfig(OneShotPruningConfig):
    pass


@MODIFIERS.register("WandaPruningModifier")
class WandaPruningModifier(OneShotPruningModifier):
    Config = WandaPruningModifierConfig

    def on_initialize(self, state) -> None:
        super().on_initialize(state)
        self.squares: dict[str, torch.Tensor] = {}  # per input column: sum of x^2 over the tokens seen

    def gather(self, name: str, x: torch.Tensor) -> None:
        columns = column_squares(x)
        self.squares[name] = columns if name not in self.squares else self.squares[name].add_(columns)

    def ready(self, names: list[str]) -> list[str]:
        waiting = [n for n in names if n in self.pending]
        if is_distributed():  # the same columns' sums on every rank
            self.squares.update(column_squares_over_ranks(self.squares, {n: self.pending[n] for n in waiting}))
        return [n for n in waiting if n in self.squares]

    def prune(self, name: str, module: nn.Module, sparsity: float) -> None:
        weight = linear_weight(module.weight, module)  # [out, in] (a Conv1D's transposed view)
        keep = wanda_mask(weight, self.squares[name].sqrt(), sparsity, self.structure)
        weight.mul_(keep.to(weight.dtype))

    def forget(self, name: str) -> None:
        self.squares.pop(name, None)


@torch.no_grad()
def wanda_mask(weight: torch.Tensor, norms: torch.Tensor, sparsity: float, structure: tuple[int, int] | None) -> torch.Tensor:
    """The keep-mask of ``weight`` ``[rows, cols]`` given its inputs' column ``norms``: in every
    row, ``round(sparsity * cols)`` of the lowest ``|W| * norm`` pruned, or N of every M
    consecutive inputs with ``structure`` (N, M)."""
    score = weight.detach().abs().float() * norms.to(device=weight.device, dtype=torch.float32)
    keep = torch.ones_like(score, dtype=torch.bool)
    rows, cols = score.shape
    if structure is not None:
        n, m = structure
        groups = score.reshape(rows, cols // m, m)
        keep.view(rows, cols // m, m).scatter_(2, groups.topk(n, dim=2, largest=False).indices, False)
        return keep
    count = round(sparsity * cols)
    if count > 0:
        keep.scatter_(1, score.topk(count, dim=1, largest=False).indices, False)
    return keep
