"""``SparseGPTModifier``: one-shot pruning that updates the weights left to make up for the ones
pruned (Frantar & Alistarh, 2023), llm-compressor's fields and meaning::

    sparsity_stage:
      sparsity_modifiers:
        SparseGPTModifier:
          sparsity: 0.5
          mask_structure: "2:4"
          ignore: ["re:.*lm_head"]

From the Hessian of each Linear's inputs (``H = 2/n X^T X``, gathered as GPTQ gathers it), the
columns go in blocks of ``block_size``. In each block the weights with the smallest
``w^2 / [H^-1]_jj^2`` are pruned (unstructured: that share of the block; N:M: N of every M inputs,
chosen on the updated weights as their group comes up), and each column's pruning error is spread
over the columns after it through the inverse Hessian's Cholesky factor, as GPTQ spreads its
rounding error. Pruned weights stay exactly zero. ``preserve_sparsity_mask``: weights already
zero stay pruned, and only the rest of the sparsity is chosen anew.
"""

from __future__ import annotations

import torch
from pydantic import model_validator
from torch import nn

from llmpress.contract.modifier import MODIFIERS
from llmpress.errors import RecipeError
from llmpress.models.linear import linear_weight
from llmpress.modifiers.gptq.algorithm import HessianFactor, factor_hessian
from llmpress.modifiers.hessians import HessianCollector
from llmpress.modifiers.pruning.oneshot import OneShotPruningConfig, OneShotPruningModifier, parse_pruned_structure
from llmpress.parallel.distributed import is_distributed

__all__ = ["SparseGPTModifier", "sparsegpt_prune"]


class SparseGPTModifierConfig(OneShotPruningConfig):
    block_size: int = 128
    dampening_frac: float = 0.01
    preserve_sparsity_mask: bool = False
    offload_hessians: bool = False

    @model_validator(mode="after")
    def _check_sparsegpt(self) -> SparseGPTModifierConfig:
        if self.block_size < 1:
            raise RecipeError("SparseGPTModifier: block_size must be positive", got=self.block_size, expected=">= 1 (e.g. 128)")
        structure = parse_pruned_structure(self.mask_structure)
        if structure is not None and self.block_size % structure[1]:
            raise RecipeError(f"SparseGPTModifier: block_size must be a multiple of M for {self.mask_structure}",
                              got=self.block_size, expected=f"a multiple of {structure[1]} (e.g. 128)")
        if not 0 <= self.dampening_frac < 1:
            raise RecipeError("SparseGPTModifier: dampening_frac must be in [0, 1)", got=self.dampening_frac)
        return self


@MODIFIERS.register("SparseGPTModifier")
class SparseGPTModifier(OneShotPruningModifier):
    Config = SparseGPTModifierConfig

    def on_initialize(self, state) -> None:
        super().on_initialize(state)
        self.hessians = HessianCollector(offload=self.config.offload_hessians)
        self.factors: dict[int, tuple[object, HessianFactor]] = {}  # one per shared Hessian (q/k/v, gate/up)
        self.losses: dict[str, float] = {}

    def gather(self, name: str, x: torch.Tensor) -> None:
        self.hessians.add(name, x)

    def ready(self, names: list[str]) -> list[str]:
        self.hessians.end_of_first_pass()
        if is_distributed():  # every rank sums every Hessian and prunes the same way
            waiting = [n for n in names if n in self.pending]
            device = next((self.pending[n].weight.device for n in waiting), torch.device("cpu"))
            self.hessians.agree(waiting, device)
            for accumulator in {id(a): a for n in waiting if (a := self.hessians.of_module.get(n)) is not None}.values():
                accumulator.reduce()
        return [n for n in names if n in self.pending and n in self.hessians.of_module]

    def prune(self, name: str, module: nn.Module, sparsity: float) -> None:
        accumulator = self.hessians.of_module[name]
        kept = self.factors.get(id(accumulator))
        if kept is None or kept[0] is not accumulator:
            kept = self.factors[id(accumulator)] = (accumulator, factor_hessian(accumulator.result().to(module.weight.device),
                                                                                self.config.dampening_frac))
        factor = kept[1]
        weight = linear_weight(module.weight, module)  # [out, in] (a Conv1D's transposed view)
        pruned, loss = sparsegpt_prune(weight, factor, sparsity, self.structure, self.config.block_size,
                                       self.config.preserve_sparsity_mask)
        weight.copy_(pruned.to(weight.dtype))
        self.losses[name] = loss

    def forget(self, name: str) -> None:
        accumulator = self.hessians.of_module.get(name)
        self.hessians.release([name])
        if accumulator is not None and not any(a is accumulator for a in self.hessians.of_module.values()):
            self.factors.pop(id(accumulator), None)  # its last module is done


@torch.no_grad()
def sparsegpt_prune(weight: torch.Tensor, factor: HessianFactor, sparsity: float, structure: tuple[int, int] | None,
                    block_size: int = 128, preserve_mask: bool = False) -> tuple[torch.Tensor, float]:
    """``weight`` ``[rows, cols]`` pruned with its Hessian's ``factor`` (no activation order),
    and the pruning loss ``sum (w - q)^2 / [H^-1]_jj^2 / 2``. ``structure``: (N, M), N of every M
    consecutive inputs pruned, else ``sparsity`` of each block of columns."""
    WT = weight.detach().t().to(torch.float32).contiguous()  # a column per row: contiguous updates
    cols = WT.shape[0]
    WT[factor.dead] = 0
    pruned_before = (WT == 0) if preserve_mask else None
    Hinv = factor.inverse
    loss = torch.zeros((), dtype=torch.float64, device=WT.device)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        block, Hinv1 = WT[start:end], Hinv[start:end, start:end]
        d = torch.diagonal(Hinv1)
        prune = _block_mask(block, d, sparsity, structure, None if pruned_before is None else pruned_before[start:end])
        Err1 = torch.empty_like(block)
        for i in range(end - start):
            if structure is not None and i % structure[1] == 0:
                _choose_group(block, d, prune, i, structure, None if pruned_before is None else pruned_before[start:end])
            w = block[i]
            err = torch.where(prune[i], w, 0.0).div_(d[i])  # (w - q) / d, q = w where kept, 0 where pruned
            loss += err.double().square().sum() / 2
            w.masked_fill_(prune[i], 0.0)
            if i + 1 < end - start:
                block[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1)
            Err1[i] = err
        if end < cols:
            WT[end:].addmm_(Hinv[start:end, end:].t(), Err1, alpha=-1)
    return WT.t(), float(loss)


def _block_mask(block: torch.Tensor, d: torch.Tensor, sparsity: float, structure: tuple[int, int] | None,
                before: torch.Tensor | None) -> torch.Tensor:
    """Unstructured: the block's ``round(sparsity * numel)`` weights of least saliency
    ``w^2 / d^2``, the ones already zero first when they are kept pruned. N:M: the weights kept
    pruned, the groups chosen as they come up (``_choose_group``)."""
    prune = torch.zeros_like(block, dtype=torch.bool) if before is None else before.clone()
    if structure is not None:
        return prune
    count = round(sparsity * block.numel()) - int(prune.sum())
    if count > 0:
        saliency = (block.square() / d[:, None].square()).masked_fill(prune, float("inf"))
        prune.view(-1)[saliency.flatten().topk(count, largest=False).indices] = True
    return prune


def _choose_group(block: torch.Tensor, d: torch.Tensor, prune: torch.Tensor, i: int, structure: tuple[int, int],
                  before: torch.Tensor | None) -> None:
    """N of the M inputs from ``i`` pruned in every row, by least saliency on the weights as the
    earlier columns' updates left them (the ones already zero first when kept pruned)."""
    n, m = structure
    saliency = block[i : i + m].square() / d[i : i + m, None].square()
    if before is not None:
        saliency = saliency.masked_fill(before[i : i + m], -1.0)
    prune[i : i + m].scatter_(0, saliency.topk(n, dim=0, largest=False).indices, True)
