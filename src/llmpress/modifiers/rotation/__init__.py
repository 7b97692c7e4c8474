"""Rotations folded into the weights before quantization (SpinQuant's R1 and R2)."""

from llmpress.modifiers.rotation.spinquant import SpinQuantModifier

__all__ = ["SpinQuantModifier"]
