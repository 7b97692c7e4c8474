"""Smoothing transforms: per-channel scales moved between a layer and the Linears reading its
output, folded into the weights (SmoothQuant)."""

from llmpress.modifiers.smoothing.mappings import Mapping, find_mappings, resolve_mappings
from llmpress.modifiers.smoothing.smoothquant import SmoothQuantModifier

__all__ = ["Mapping", "SmoothQuantModifier", "find_mappings", "resolve_mappings"]
