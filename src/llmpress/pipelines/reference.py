"""The reference strategy for one block: read this first.

For each group of the block's targets (the modules the modifiers watch, and every Linear; all
at once, or one group at a time module by module): run every batch through the block with only
that group observed (no run when nobody watches it), and let the modifiers compress the group
(``modules_calibrated``). Then ``layer_calibrated``, and one more
run, unobserved, with everything compressed, whose outputs become the next block's inputs::

    for group in groups:                         # [all targets] for two passes
        run the block on every batch, observing only `group`, each batch only as far as
            the last input of `group` (once a batch showed where that is)
        session.modules_calibrated(block, group)
    session.layer_calibrated(block)
    run the block on every batch, unobserved: outputs -> next block's inputs

Module by module, each group is calibrated on the outputs of the compressed groups before it
(the GPTQ paper's "true sequential" order). ``sequential.py`` computes the same thing with every
Linear multiplying once; tests hold it to this one.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.contract.block import CalibrationBlock
from llmpress.contract.observation import InputsSeen, Observation
from llmpress.models.experts import routed_experts_only
from llmpress.pipelines.blocks import hand_on
from llmpress.session import Session

__all__ = ["calibrate_block_reference", "observe_block", "run_block"]


@torch.no_grad()
def calibrate_block_reference(block: CalibrationBlock, session: Session, groups: list[list[nn.Module]],
                              outputs_needed: bool) -> tuple | None:
    """Calibrate ``block`` group by group; returns what the block returns besides its hidden
    states (for the tail pass), None when it returns them alone or ``outputs_needed`` is False."""
    observation = session.observation
    for group in filter(None, groups):
        if any(observation.watches(m) for m in group):  # else there is nothing to observe
            observe_block(block, observation, group)
        session.modules_calibrated(block, group)
    session.layer_calibrated(block)
    if not outputs_needed:
        return None
    with observation.paused():
        return run_block(block)


@torch.no_grad()
def observe_block(block: CalibrationBlock, observation: Observation, group: list[nn.Module]) -> None:
    """Run every batch through the block with only ``group`` observed. Only the inputs are
    wanted, so once a batch has fed every watched module of the group exactly once, later
    batches stop right after that many inputs (``Observation.until``): what follows the last
    one is not computed (a Llama block's down_proj product, a quarter of its Linear work; a
    q/k/v group's attention and MLP). A batch that feeds other modules or counts runs whole;
    a block that feeds some module twice, or leaves one unfed (an expert no token reached),
    never stops early."""
    watched = {m for m in group if observation.watches(m)}
    enough = None
    with observation.only(group):
        for args, kwargs in block.inputs:
            with observation.until(enough) as fed:
                try:
                    block.module(*args, **kwargs)
                except InputsSeen:
                    continue
            if enough is None and set(fed) == watched and set(fed.values()) == {1}:
                enough = fed


@torch.no_grad()
def run_block(block: CalibrationBlock) -> tuple | None:
    """Replace each batch's input by the block's output, one batch at a time (so only one batch
    of the two is ever alive twice); returns what the block returns besides its hidden states."""
    rest = None
    with routed_experts_only(block.module):  # nobody observes: experts take only their tokens
        for index, (args, kwargs) in enumerate(block.inputs):
            rest = hand_on(block.inputs, index, block.module(*args, **kwargs))
    return rest
