"""Rotations before quantization: SpinQuant's R1 and R2 folded into the weights and its R4 at
run time, QuIP's on each side of every Linear."""

from llmpress.modifiers.rotation.quip import QuIPModifier
from llmpress.modifiers.rotation.spinquant import SpinQuantModifier

__all__ = ["QuIPModifier", "SpinQuantModifier"]
