"""Pruning during training: gradual magnitude pruning and keeping existing zeros."""

from llmpress.modifiers.pruning.constant import ConstantPruningModifier
from llmpress.modifiers.pruning.magnitude import (
    MagnitudePruningModifier,
    cubic_sparsity,
)

__all__ = ["ConstantPruningModifier", "MagnitudePruningModifier", "cubic_sparsity"]
