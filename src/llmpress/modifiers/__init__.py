"""Modifiers: one folder per algorithm, registered by class name for recipes."""

from llmpress.modifiers.base import MODIFIERS, Modifier, ModifierConfig
from llmpress.modifiers.gptq import GPTQModifier
from llmpress.modifiers.quantization import QuantizationModifier

__all__ = ["MODIFIERS", "GPTQModifier", "Modifier", "ModifierConfig", "QuantizationModifier"]
