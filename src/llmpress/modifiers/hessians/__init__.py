"""Input Hessians ``sum x x^T`` gathered from calibration inputs: GPTQ's, SparseGPT's, AWQ's
scores' and mixed precision's statistics (a folder of its own, so that reading them imports no
algorithm)."""

from llmpress.modifiers.hessians.accumulate import HessianAccumulator, HessianCollector

__all__ = ["HessianAccumulator", "HessianCollector"]
