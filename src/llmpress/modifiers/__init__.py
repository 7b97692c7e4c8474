"""Modifiers: one folder per algorithm, registered by class name for recipes."""

from llmpress.contract.modifier import MODIFIERS, Modifier, ModifierConfig, OneShotFields, Window, WindowFields
from llmpress.modifiers.autoround import AutoRoundModifier
from llmpress.modifiers.distillation import OutputDistillationModifier
from llmpress.modifiers.gptq import GPTQModifier
from llmpress.modifiers.learning_rate import LearningRateModifier
from llmpress.modifiers.mixed_precision.modifier import MixedPrecisionModifier
from llmpress.modifiers.pruning import ConstantPruningModifier, MagnitudePruningModifier, SparseGPTModifier, WandaPruningModifier
from llmpress.modifiers.quantization import QuantizationModifier
from llmpress.modifiers.rotation import QuIPModifier, SpinQuantModifier
from llmpress.modifiers.smoothing import AWQModifier, LogarithmicEqualizationModifier, SmoothQuantModifier

__all__ = [
    "MODIFIERS",
    "AWQModifier",
    "AutoRoundModifier",
    "ConstantPruningModifier",
    "GPTQModifier",
    "LearningRateModifier",
    "MagnitudePruningModifier",
    "MixedPrecisionModifier",
    "Modifier",
    "ModifierConfig",
    "OneShotFields",
    "OutputDistillationModifier",
    "QuIPModifier",
    "QuantizationModifier",
    "LogarithmicEqualizationModifier",
    "SmoothQuantModifier",
    "SparseGPTModifier",
    "SpinQuantModifier",
    "WandaPruningModifier",
    "Window",
    "WindowFields",
]
