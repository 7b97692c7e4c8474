from llmpress.modifiers.quantization.config import QuantizationModifierConfig
from llmpress.modifiers.quantization.modifier import QuantizationModifier

__all__ = ["QuantizationModifier", "QuantizationModifierConfig"]
