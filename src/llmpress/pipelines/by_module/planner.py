"""Which blocks go module by module, and with which plan (``plan.py``): the automatic choice
between module by module and two passes, made once for the blocks alike."""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmpress.contract.block import CalibrationBlock, structure_of, tokens_per_batch
from llmpress.memory import release_free_memory
from llmpress.parallel.distributed import is_distributed, sum_across_ranks
from llmpress.pipelines.by_module.plan import BlockPlan, kept_bytes, plan_block

__all__ = ["KEPT_PER_BLOCK_WEIGHTS", "Planner"]

logger = logging.getLogger(__name__)

#: automatic ``true_sequential``: module by module while what a block's stages keep is at most
#: this many times the block's own weights (a 1024-hidden Llama on 64 x 256 tokens: 5x; the
#: 5M-parameter test model: 21x, where the kept activations would be a fifth of its peak memory)
KEPT_PER_BLOCK_WEIGHTS = 8


class Planner:
    """Each block's module-by-module plan, or None (logged) where it takes two passes. A block
    like one planned before (the same structure, targets and batches: a model's repeated layers)
    takes that block's plan, moved to its own modules, without a probe of its own (a forward of
    its first batch, traced); one like a block refused for what it would keep is refused."""

    def __init__(self, automatic: bool, by_module: bool) -> None:
        self.automatic, self.by_module = automatic, by_module
        self.refused: dict[tuple, str] = {}
        self.planned: dict[tuple, tuple[BlockPlan, dict[nn.Module, str]]] = {}  # key -> plan, its block's names

    def plan(self, block: CalibrationBlock, targets: list[nn.Module]) -> BlockPlan | None:
        if not self.by_module:
            return None
        names = {m: n for n, m in block.module.named_modules()}
        watched = block.observation.watchers if block.observation is not None else {}
        key = (structure_of(block.module), tuple(p.dtype for p in block.module.parameters()),
               tuple((names.get(m), m in watched) for m in targets), tuple(tokens_per_batch(block.inputs)))
        if key in self.refused:
            logger.debug("block %d is calibrated in two passes, as the blocks like it: %s", block.index, self.refused[key])
            return None
        if key in self.planned:
            plan, planned_names = self.planned[key]
            return plan.moved_to(block.module, planned_names)
        plan = plan_block(block.module, block.inputs[0], targets, block.observation)
        release_free_memory()  # the probe's activations
        kept = kept_bytes(plan, block.inputs) if isinstance(plan, BlockPlan) else 0
        if is_distributed():  # what one process would keep, and one way for every rank (their collectives meet)
            summed = sum_across_ranks(torch.tensor([float(kept), float(not isinstance(plan, BlockPlan))], dtype=torch.float64))
            kept = int(summed[0])
            if isinstance(plan, BlockPlan) and summed[1] > 0:
                plan = "another rank's probe found no plan for it"
        if not isinstance(plan, BlockPlan):
            reason = plan
        else:
            budget = KEPT_PER_BLOCK_WEIGHTS * sum(p.numel() * p.element_size() for p in block.module.parameters())
            if not (self.automatic and kept > budget):
                self.planned[key] = plan, names
                return plan
            reason = (f"it would keep {kept / 2**20:.0f} MB of activations, "
                      f"over {KEPT_PER_BLOCK_WEIGHTS}x the block's weights ({budget / 2**20:.0f} MB)")
            self.refused[key] = reason  # (other reasons may come from the probe's batch: an expert it missed)
        logger.info("block %d is calibrated in two passes, not module by module: %s", block.index, reason)
        return None
