"""Decode through ``torch.compile``: a model's ``generate()`` with a static KV cache and its
decode step compiled once (Inductor's C++ backend on the CPU).

A decode step of a small model is hundreds of small PyTorch calls; compiled, the step runs as a
few generated C++ loops around the quantized products (llmpress's int4 operator is opaque to the
compiler and called as it is). Measured here (2 cores): SmolLM2-135M's shapes, int4, 21 → 34
tokens/s (with PyTorch's attention as it is; plain matrix products measured the same); the
2048-hidden Llama, whose time is its products, gains nothing. The compile costs
about 80 s on 2 cores the first time a shape is seen (Inductor's cache on disk makes later
processes faster), which is why it is asked for, not the default.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["compile_decode", "kernel_report", "path_name"]

logger = logging.getLogger(__name__)


def compile_decode(model: nn.Module) -> nn.Module:
    """Make ``model.generate()`` decode with a static cache through a compiled step (in place).

    The first ``generate()`` of each cache length compiles (the cache is sized to the prompt
    plus ``max_new_tokens``); sampling, stopping criteria and batches work as before."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = config
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        logger.warning("%s's quantizer does not support torch.compile: generate() will decode uncompiled", type(quantizer).__name__)
    return model


def path_name(kernel: str) -> str:
    """A ``QuantizedLinear.kernel`` as reports name it: whose int4 kernel runs, others as they are."""
    from llmpress.runtime import kernels

    if kernel != "int4":
        return kernel
    return "int4 (llmpress)" if kernels.int4_layout() == "blocks64" else "int4 (pytorch)"


def kernel_report(model: nn.Module) -> dict[str, int]:
    """How many linear layers run on which path: ``int4 (llmpress)`` / ``int4 (pytorch)``,
    ``int8``, ``int8x8``, ``bf16``, ``dequant`` (decompressed at every call) or ``dense``."""
    from llmpress.models.linear import is_linear
    from llmpress.runtime import QuantizedLinear

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            name = path_name(module.kernel)
        elif is_linear(module):
            name = "dense"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts
