"""Pruning: one-shot on calibration data (SparseGPT, Wanda) and during training (gradual
magnitude pruning, keeping existing zeros)."""

from llmpress.modifiers.pruning.constant import ConstantPruningModifier
from llmpress.modifiers.pruning.magnitude import (
    MagnitudePruningModifier,
    cubic_sparsity,
)
from llmpress.modifiers.pruning.sparsegpt import SparseGPTModifier
from llmpress.modifiers.pruning.wanda import WandaPruningModifier

__all__ = ["ConstantPruningModifier", "MagnitudePruningModifier", "SparseGPTModifier", "WandaPruningModifier", "cubic_sparsity"]
