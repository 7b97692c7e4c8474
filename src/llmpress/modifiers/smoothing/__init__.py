"""Smoothing transforms: per-channel scales moved between a layer and the Linears reading its
output, folded into the weights (SmoothQuant, AWQ)."""

from llmpress.modifiers.smoothing.awq import AWQModifier
from llmpress.modifiers.smoothing.mappings import Mapping, find_mappings, resolve_mappings
from llmpress.modifiers.smoothing.smoothquant import LogarithmicEqualizationModifier, SmoothQuantModifier

__all__ = ["AWQModifier", "LogarithmicEqualizationModifier", "Mapping", "SmoothQuantModifier", "find_mappings", "resolve_mappings"]
