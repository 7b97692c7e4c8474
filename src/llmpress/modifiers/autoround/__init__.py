"""AutoRound: rounding and clipping tuned block by block by signed gradient descent."""

from llmpress.modifiers.autoround.modifier import AutoRoundModifier

__all__ = ["AutoRoundModifier"]
