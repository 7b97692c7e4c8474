"""Runtime modules: compressed weights kept compressed in memory and run with CPU kernels."""

from llmpress.runtime.linear import QuantizedLinear

__all__ = ["QuantizedLinear"]
