"""Layer by layer without calibration data: a data-free recipe on a model saved from its held layers."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.contract.block import CalibrationBlock
from llmpress.memory import release_free_memory
from llmpress.parallel.distributed import is_main_process
from llmpress.pipelines.storage.compact import CompactWeights
from llmpress.session import Session

__all__ = ["compress_blocks_without_data"]


@torch.no_grad()
def compress_blocks_without_data(model: nn.Module, blocks: nn.ModuleList, session: Session) -> None:
    """A recipe that needs no calibration forward (RTN, say), for a model saved from its held
    layers: each block compressed in turn (``layer_calibrated``, no inputs) and held as integers
    at once, so one block is in float at a time, as with calibration data; the rest of the model
    (a quantized head) at ``calibration_end``."""
    session.calibration_start()
    held = CompactWeights(model)
    try:
        with tqdm(blocks, desc="Compressing layers", unit="layer", disable=not is_main_process()) as bar:  # closed on an error too
            for index, module in enumerate(bar):
                session.layer_calibrated(CalibrationBlock(index, module, [], session.observation))
                held.hold(module)
                release_free_memory()  # the block's float weights go back
    except BaseException:
        session.abandon_calibration()
        held.restore()
        raise
    held.attach(model)
    session.calibration_end()
