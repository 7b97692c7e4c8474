"""Whole-model calibration: every batch runs through the full model once.

The session hands the modifiers the inputs of the modules they observe (``contract/observation.py``)
between ``calibration_start`` and ``calibration_end``. When no modifier needs data (weight-only
RTN, dynamic activations) no batch runs at all.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.session import Session

__all__ = ["run_basic_calibration"]

logger = logging.getLogger(__name__)


def run_basic_calibration(model: nn.Module, session: Session, batches: list[torch.Tensor]) -> None:
    session.calibration_start()
    if session.needs_calibration_forward:
        device = next(model.parameters()).device
        try:
            with torch.no_grad():
                for batch in tqdm(batches, desc="Calibrating", unit="batch", leave=False):
                    model(input_ids=batch.to(device))
        except BaseException:
            session.abandon_calibration()  # the modifiers' hooks leave the model
            raise
    session.calibration_end()
