"""Decode through ``torch.compile``: ``generate()`` with a static KV cache and its decode step
compiled once (Inductor's C++ backend on the CPU), which ``llmpress.load`` sets up by default.

A decode step of a small model is hundreds of small PyTorch calls; compiled, the step runs as a
few generated C++ loops around the quantized products (llmpress's int4 operator is opaque to the
compiler and called as it is). A small model's decode gains the most (a few ms a token); a large
one, whose time is its products, gains less. The compile is paid by the first compiled
``generate()`` of each static cache size: tens of seconds on 2 cores for a 30-layer model the
first time, less once Inductor's cache on disk holds its code (the figures: ``bench/README.md``, "Figures behind the code").

So the compile waits until it can pay: by default a model decodes as transformers does until it
has generated ``COMPILE_AFTER_TOKENS`` tokens (or one call asks for that many), and compiled from
then on; ``compile_decode(model, after_tokens=0)`` (``load(..., compile_decode=True)``,
``llmpress generate --compile``) compiles from the first call.

The compile settings go into each ``generate()`` call, not into ``model.generation_config``,
so a model saved afterwards keeps its own generation config. Cache sizes are rounded up to a
power of two (at least 256 positions) so that prompts of other lengths reuse the compiled step
instead of compiling another; transformers keeps the largest cache so far for later calls.
A call that brings its own cache, another cache implementation or ``disable_compile=True``
runs as transformers runs it.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from llmpress.compat import compile_config, cpp_compiler_available, previous_cache_length
from llmpress.lifecycle.kv_cache import kv_cache_scheme_of
from llmpress.models.linear import is_linear
from llmpress.runtime import kernels
from llmpress.runtime.fusion import fuse_projections
from llmpress.runtime.linear import QuantizedLinear

__all__ = [
    "COMPILE_AFTER_TOKENS", "MIN_CACHE_POSITIONS", "CompiledGenerate", "can_compile", "compile_decode", "compiles", "is_compiled",
    "kernel_report", "path_name", "prepare_decode",
]

logger = logging.getLogger(__name__)

MIN_CACHE_POSITIONS = 256
#: tokens generated before the decode step compiles, by default: the one-off compile pays after a
#: few thousand tokens on a small model (bench/README.md, "Figures behind the code")
COMPILE_AFTER_TOKENS = 1024


def compiles(model: nn.Module) -> bool:
    """Whether ``model.generate()`` goes through ``compile_decode`` (compiled now or later)."""
    return isinstance(model.__dict__.get("generate"), CompiledGenerate)


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model.generate()`` has decoded through a compiled step."""
    return compiles(model) and bool(model.generate.compiled_sizes)


def prepare_decode(model: nn.Module, compile_step: bool | None = None) -> None:
    """What ``llmpress.load`` does for decoding: fuse the int4 products that read the same input
    (``fusion.py``), and compile ``generate()``'s decode step: from the first call when
    ``compile_step`` is true, after ``COMPILE_AFTER_TOKENS`` tokens when it is None and
    ``can_compile(model)``."""
    fuse_projections(model)
    if compile_step:
        compile_decode(model)
    elif compile_step is None and can_compile(model):
        compile_decode(model, after_tokens=COMPILE_AFTER_TOKENS)


def can_compile(model: nn.Module) -> bool:
    """Whether ``llmpress.load`` compiles ``model``'s decode by default: a model that generates,
    on the CPU, where Inductor finds a C++ compiler, without an fp8 KV cache (whose hooks wrap
    the cache), unless ``LLMPRESS_COMPILE=0``."""
    if os.environ.get("LLMPRESS_COMPILE", "1") == "0":
        return False
    if not getattr(model, "can_generate", lambda: False)() or any(p.device.type != "cpu" for p in model.parameters()):
        return False
    if kv_cache_scheme_of(model) is not None:
        return False
    if not cpp_compiler_available():
        logger.info("no C++ compiler for torch.compile: generate() decodes uncompiled")
        return False
    return True


def compile_decode(model: nn.Module, after_tokens: int = 0) -> nn.Module:
    """Make ``model.generate()`` decode with a static cache through a compiled step (in place),
    once the model has generated ``after_tokens`` tokens (counting the call that crosses it). The
    first compiled ``generate()`` of each cache size compiles; sampling, stopping criteria and
    batches work as before."""
    if compiles(model):
        model.generate.after_tokens = after_tokens
        return model
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        logger.warning("%s's quantizer does not support torch.compile: generate() will decode uncompiled", type(quantizer).__name__)
        return model
    model.generate = CompiledGenerate(model, after_tokens)
    return model


class CompiledGenerate:
    """``model.generate`` with the compile settings added to each call (an object, not a
    closure: a deep copy or a pickle of the model gets one bound to the copy)."""

    def __init__(self, model: nn.Module, after_tokens: int = 0) -> None:
        self.model, self.after_tokens = model, after_tokens
        self.eager_tokens = 0  # generated before the first compile
        self.compiled_sizes: set[tuple[int, int]] = set()
        self._compiled: dict[str, Any] = {}  # transformers' compiled forward, between calls
        self.__doc__ = type(model).generate.__doc__

    def __call__(self, *args: Any, **kwargs: Any):
        model, generate = self.model, type(self.model).generate
        if not _compiles(model, args, kwargs):
            return generate(model, *args, **kwargs)
        batch, needed, new = _cache_shape(model, args, kwargs)
        if not self.compiled_sizes and self.eager_tokens + batch * (new or 0) < self.after_tokens:
            out = generate(model, *args, **kwargs)  # not yet worth a compile: count what it generated
            sequences, prompt = getattr(out, "sequences", out), _prompt(args, kwargs)
            given = prompt.shape[1] if prompt is not None and not prompt.is_floating_point() else 0  # (embeddings: new ids only)
            self.eager_tokens += batch * max(0, sequences.shape[-1] - given)
            return out
        kwargs.setdefault("cache_implementation", "static")
        kwargs.setdefault("compile_config", compile_config())
        if needed and "max_cache_len" not in kwargs:
            kwargs["max_cache_len"] = max(MIN_CACHE_POSITIONS, 1 << (needed - 1).bit_length())
        size = (batch, max(kwargs.get("max_cache_len") or 0, previous_cache_length(model)))
        first = size not in self.compiled_sizes
        if first:
            logger.info("compiling the decode step for batch %d and a static cache of %d positions (once per model and size)", *size)
        start = time.perf_counter()
        # transformers keeps its compiled forward on the model: here it is kept on this object
        # instead, so that a copy or a pickle of the model does not carry the original's
        model.__dict__.update(self._compiled)
        try:
            out = generate(model, *args, **kwargs)
        finally:
            self._compiled = {k: model.__dict__.pop(k) for k in _COMPILED_ATTRS if k in model.__dict__}
        if first:
            self.compiled_sizes.add(size)
            logger.info("the first generate() of this size took %.1fs, compile included", time.perf_counter() - start)
        return out

    def __deepcopy__(self, memo: dict) -> CompiledGenerate:
        return CompiledGenerate(copy.deepcopy(self.model, memo), self.after_tokens)  # the model's copy is already in memo

    def __reduce__(self):
        return CompiledGenerate, (self.model, self.after_tokens)


#: what transformers' generate() sets on a model it compiles (``get_compiled_call``)
_COMPILED_ATTRS = ("_compiled_call", "_last_compile_config")


def _setting(model: nn.Module, args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    """A generation setting as the call resolves it: its keyword, else its generation config's
    (a keyword or the second positional argument), else the model's."""
    if name in kwargs:
        return kwargs[name]
    given = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    for config in (given, getattr(model, "generation_config", None)):
        if config is not None and getattr(config, name, None) is not None:
            return getattr(config, name)
    return None


def _compiles(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call leaves the cache and the compile to us: no cache of its own, no other
    cache implementation, caching on, compiling not disabled, no assistant model."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("assistant_model"):
        return False
    if _setting(model, args, kwargs, "disable_compile") or _setting(model, args, kwargs, "use_cache") is False:
        return False
    return _setting(model, args, kwargs, "cache_implementation") in (None, "static")


def _prompt(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's prompt, ``[batch, tokens]`` ids or ``[batch, tokens, hidden]`` embeddings."""
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    return inputs if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else None


def _cache_shape(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[int, int | None, int | None]:
    """(batch, positions the call needs, new tokens it asks for); None where the call does not say."""
    inputs = _prompt(args, kwargs)
    if inputs is None:
        return 1, None, None
    new = _setting(model, args, kwargs, "max_new_tokens")
    if new is not None:
        return inputs.shape[0], inputs.shape[1] + new, new
    length = _setting(model, args, kwargs, "max_length")
    return inputs.shape[0], length, None if length is None else max(0, length - inputs.shape[1])


def path_name(kernel: str) -> str:
    """A ``QuantizedLinear.kernel`` as reports name it: whose int4 kernel runs, others as they are."""
    if kernel != "int4":
        return kernel
    return "int4 (llmpress)" if kernels.int4_layout() == "blocks64" else "int4 (pytorch)"


def kernel_report(model: nn.Module) -> dict[str, int]:
    """How many linear layers run on which path: ``int4 (llmpress)`` / ``int4 (pytorch)``,
    ``int8``, ``int8x8``, ``bf16``, ``dequant`` (decompressed at every call) or ``dense``."""
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
