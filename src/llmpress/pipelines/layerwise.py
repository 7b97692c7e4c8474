"""Layer-by-layer calibration: bounded memory, no graph tracing.

The calibration batches run to the first of the model's repeated blocks (``model.model.layers``
and its equivalents; ``contract/block.py``), and then each block is calibrated on its cached
inputs and its compressed outputs become the next block's inputs, so only one block's
activations are in flight. A block goes module by module where the modifiers and the block allow
and what it keeps fits the budget (``by_module/sequential.py``), else in two passes
(``reference.py`` with one group: observe everything, compress, re-run). Blocks not reached yet
stay where they were read (memory-mapped by ``read_checkpoint``), and finished blocks wait as
integers (``storage/compact.py``) until calibration ends. Watched modules after the blocks (an
lm_head the recipe quantizes, an encoder's head) then run on the last block's outputs
(``tail.py``). Models without a list of blocks are calibrated whole, with a warning.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.contract.block import BlockArguments, CalibrationBlock, Inputs, find_blocks
from llmpress.contract.observation import primary_input
from llmpress.errors import SessionError
from llmpress.memory import release_free_memory
from llmpress.models.linear import is_linear
from llmpress.parallel.distributed import assign_owners, gather_objects_on, is_distributed, is_main_process, rank
from llmpress.pipelines.basic import run_basic_calibration
from llmpress.pipelines.blocks import capture_block_inputs, share_repeated
from llmpress.pipelines.by_module.planner import Planner
from llmpress.pipelines.by_module.sequential import calibrate_block_by_module
from llmpress.pipelines.data_free import compress_blocks_without_data
from llmpress.pipelines.reference import calibrate_block_reference, run_block
from llmpress.pipelines.storage.compact import CompactWeights
from llmpress.pipelines.storage.kept import close_spill_files
from llmpress.pipelines.storage.onload import Placement
from llmpress.pipelines.storage.resume import WorkFolder
from llmpress.pipelines.tail import TailError, run_tail
from llmpress.session import Session

__all__ = ["run_layerwise_calibration"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def run_layerwise_calibration(model: nn.Module, session: Session, batches: list[torch.Tensor],
                              true_sequential: bool | None = None, work: WorkFolder | None = None,
                              spill: bool = True, keep_held: bool = False, device: str | torch.device | None = None,
                              compute_dtype: torch.dtype | str | None = None) -> None:
    """``true_sequential``: True calibrates each block's modules group by group, each on the
    outputs of the compressed ones before it, where the modifiers and the block allow; False: two
    passes per block; None: module by module while the activations it keeps stay within
    ``KEPT_PER_BLOCK_WEIGHTS`` (``by_module/planner.py``) times the block's weights. ``work``:
    each finished block is kept there, and the blocks an earlier run of it finished are put back
    instead of calibrated (``resume.py``). ``spill``: the blocks' inputs and what their stages
    keep go to files in the work folder (else the system's temporary folder) and come back one
    batch at a time (``kept.py``). ``keep_held``: the finished layers' weights stay held as
    integers after calibration (``held_weights(model)``), for one save that writes them, letting
    each go, without rebuilding the model in float (the model is then spent:
    ``CompactWeights.weight_of``); a recipe that needs no calibration data then compresses and
    holds the blocks one by one too.
    ``device``: where each block calibrates (``onload.execution_device``; by default a CUDA GPU
    when the model is in host memory and there is one): the block moves there and back.
    ``compute_dtype``: the dtype each block calibrates in (``onload.compute_dtype``; by default
    the model's own, but float32 for a bf16 model on a CPU without bf16 units)."""
    if not session.needs_calibration_forward:
        blocks = find_blocks(model) if keep_held else None
        if blocks is not None and all("layer_calibrated" in m.events for m in session.modifiers):
            compress_blocks_without_data(model, blocks, session)
        else:
            session.calibration_start()
            session.calibration_end()
        return
    blocks = find_blocks(model)
    place = Placement.of(model, device, compute_dtype)
    if place.dtype is not None:
        why = "" if compute_dtype is not None else " (this CPU has no bf16 / fp16 matrix units: PyTorch would emulate them)"
        logger.info("calibrating each layer in %s%s; the model stays in %s", str(place.dtype).replace("torch.", ""), why,
                    str(place.stored).replace("torch.", ""))
    if blocks is None:
        if place.device != place.home:
            logger.warning("calibrating %s where it is (%s), not on %s: it has no repeated blocks to move one at a time",
                           type(model).__name__, place.home, place.device)
        logger.warning("no repeated blocks found in %s: calibrating the whole model at once", type(model).__name__)
        run_basic_calibration(model, session, batches)
        return
    session.calibration_start()
    held = CompactWeights(model)  # finished blocks wait as integers: one block in float at a time
    try:
        folder = None if not spill else work.path if work is not None else Path(tempfile.gettempdir())
        _calibrate(model, blocks, session, batches, true_sequential, held, work, folder, place)
    except BaseException:
        session.abandon_calibration()  # the modifiers' hooks leave the model
        held.restore()
        raise
    finally:
        close_spill_files()
    if keep_held:
        held.attach(model)
    else:
        held.restore()
    session.calibration_end()


def _calibrate(model: nn.Module, blocks: nn.ModuleList, session: Session, batches: list[torch.Tensor],
               true_sequential: bool | None, held: CompactWeights, work: WorkFolder | None, spill: Path | None,
               place: Placement) -> None:
    observation = session.observation
    if place.device != place.home:
        logger.info("calibrating each layer on %s; the model stays on %s", place.device, place.home)
    inputs, reached, arguments = capture_block_inputs(model, blocks, batches, place.home, observation, spill)
    share_repeated(inputs)
    inside = set(blocks.modules())
    tail = [m for m in observation.targets if m not in inside and m not in reached]  # e.g. a quantized lm_head
    rest = _calibrate_blocks(blocks, inputs, session, true_sequential, outputs_needed_at_end=bool(tail), held=held, work=work,
                             spill=spill, place=place, arguments=arguments)
    if tail:
        try:
            run_tail(model, blocks, batches, [primary_input(*batch) for batch in inputs], rest, tail, place.home, observation)
        except TailError as exc:
            logger.warning("could not run %s's modules after its blocks on their outputs (%s): "
                           "they get no calibration data", type(model).__name__, exc)
    inputs.clear()
    release_free_memory()  # the activations go back before the float weights return


def _calibrate_blocks(blocks: nn.ModuleList, inputs: Inputs, session: Session, true_sequential: bool | None,
                      outputs_needed_at_end: bool, held: CompactWeights, work: WorkFolder | None,
                      spill: Path | None, place: Placement, arguments: BlockArguments | None = None) -> tuple | None:
    """Each block in turn, each on ``place.device`` with its own arguments (``arguments``);
    returns what the last block returns besides its hidden states (at home)."""
    watched = set(session.observation.targets)
    by_module = true_sequential is not False and session.calibrates_by_module
    if true_sequential and not by_module:
        logger.info("two passes per block: a modifier of this stage does not compress group by group (modules_calibrated)")
    planner = Planner(automatic=true_sequential is None, by_module=by_module)
    start, rest = _restore_finished(blocks, inputs, session, held, work, spill, place, arguments)
    # closed on the way out of an error too, so that the error starts on a line of its own
    with tqdm(total=len(blocks), initial=start, desc="Calibrating layers", unit="layer", disable=not is_main_process()) as bar:
        for index, module in enumerate(blocks):
            if index < start:
                continue
            outputs_needed = index + 1 < len(blocks) or outputs_needed_at_end  # they feed what follows
            # the watched modules and every linear: each one is handed over (modules_calibrated) in
            # its place, so a modifier compresses the unwatched ones (RTN, say) before later stages
            targets = [m for m in module.modules() if m in watched or is_linear(m)]
            if arguments is not None:
                arguments.adopt(inputs, index)
            with place.block(module):
                block = CalibrationBlock(index, module, place.inputs(inputs), session.observation, spill)
                plan = planner.plan(block, targets) if any(m in watched for m in targets) else None
                block.observed_at_once = plan is None
                session.block_start(block)  # transforms first (smoothing): the block is then calibrated as it will be
                if plan is None:
                    rest = calibrate_block_reference(block, session, [targets], outputs_needed)
                else:
                    rest = calibrate_block_by_module(block, plan, session, outputs_needed)
                rest = place.back(rest)
            # another rank maps the integers rank 0 writes into the work folder: the same weights, held once
            from_rank_zero = work is not None and not is_main_process()
            if work is not None and is_distributed():
                _hold_on_rank_zero(module, held)
            else:
                held.hold(module)
            if work is not None:
                state_file = work.save_layer(index, module, held, inputs if outputs_needed else [], rest, session.resume_notes())
                if state_file is not None:
                    held.page_out(module, state_file, adopt=from_rank_zero)  # its integers wait in that file, not in memory
                elif from_rank_zero:  # a rank on another machine: no such file here
                    held.hold(module)
            bar.set_postfix_str(session.step_notes(), refresh=False)  # each module's error, e.g. GPTQ's loss
            bar.update()
            release_free_memory()  # the block's solver temporaries and float weights go back
    return rest


def _hold_on_rank_zero(layer: nn.Module, held: CompactWeights) -> None:
    """Rank 0 holds ``layer``'s weights as integers, for the work folder, each rank rounding a
    share of its modules (by size) for it: rank 0 alone rounded them all while the others waited."""
    modules = [m for m in layer.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)]
    owners = assign_owners([float(m.weight.numel()) for m in modules])
    found = gather_objects_on({i: held.integers(m) for i, m in enumerate(modules) if owners[i] == rank()}, dst=0)
    if found is not None:
        held.hold(layer, {modules[i]: k for share in found for i, k in share.items()})


def _restore_finished(blocks: nn.ModuleList, inputs: Inputs, session: Session, held: CompactWeights,
                      work: WorkFolder | None, spill: Path | None, place: Placement,
                      arguments: BlockArguments | None) -> tuple[int, tuple | None]:
    """Put back the blocks an earlier run of this one finished (``work``), and the inputs of the
    next (``inputs`` holds the first block's): the last ones written, through the finished
    blocks after them. Returns how many, and what the last returned besides its hidden states."""
    done = 0 if work is None else min(work.layers_done, len(blocks))
    if not done:
        return 0, None
    if not session.restores_layers:
        raise SessionError(
            "this run cannot resume: a modifier of its recipe cannot take back a finished layer",
            got=", ".join(type(m).__name__ for m in session.modifiers if "layer_restored" not in m.events),
            expected="modifiers with an on_layer_restored hook (GPTQ, QuantizationModifier, AWQ, SmoothQuant)",
            fix="run without --resume",
        )
    for index in range(done):
        work.restore_layer(index, blocks[index], held)
        session.layer_restored(CalibrationBlock(index, blocks[index], [], session.observation))
    session.take_resume_notes(work.notes)
    written, rest = min(work.inputs_after, done - 1), None
    if written >= 0:
        inputs[:], rest = work.last_inputs()
        if arguments is not None:
            arguments.holding = None  # whichever block's arguments they were written with
    for index in range(written + 1, done):  # finished after the inputs were last written: forward them
        if arguments is not None:
            arguments.adopt(inputs, index)
        held.release(blocks[index])
        with session.observation.paused(), place.block(blocks[index]):
            rest = place.back(run_block(CalibrationBlock(index, blocks[index], place.inputs(inputs), session.observation, spill)))
        held.hold(blocks[index])
    logger.info("resumed after layer %d of %d%s", done - 1, len(blocks),
                f" (forwarded layers {written + 1}-{done - 1} on the inputs written after layer {written})" if written < done - 1 else "")
    return done, rest
