from llmpress.modifiers.gptq.config import GPTQModifierConfig
from llmpress.modifiers.gptq.modifier import GPTQModifier

__all__ = ["GPTQModifier", "GPTQModifierConfig"]
