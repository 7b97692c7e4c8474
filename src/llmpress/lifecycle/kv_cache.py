"""The KV cache on a quantization grid (``kv_cache_scheme``): keys and values in fp8 e4m3 with
static scales per tensor or per attention head, as llm-compressor writes them and vLLM runs them.

Each attention module (a class named ``...Attention`` with a cache parameter and key / value
projections) gets ``k_scale`` / ``v_scale`` and a forward pre-hook that hands it a
stand-in cache. transformers' attention calls ``update(key_states, value_states, ...)`` with the
keys after rotary embedding, which is what is cached; the stand-in observes them (calibration:
the largest magnitude seen, per tensor or per head) or puts them on the fp8 grid (once the scales
are set), then passes them on to the real cache when there is one. compressed-tensors does the
same when transformers loads the checkpoint (its ``QuantizedKVCache``), where it recognises the
attention: with transformers 5.17 + compressed-tensors 0.19 both compute alike; compressed-tensors
0.20.1 looks for ``past_key_values`` only, and transformers 5.2x names the argument ``cache``, so
it skips the scales there (an upstream mismatch, measured in ``bench/recipes.py``).
The cached values are on the fp8 grid in the model's dtype: the quality is the fp8 cache's, the
memory is not reduced on a CPU.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from llmpress.errors import SchemeError
from llmpress.lifecycle.attach import set_module_buffer
from llmpress.lifecycle.state import existing_state, forget_state_if_empty, state_of
from llmpress.quant.qdq import compute_qparams, fake_quantize
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["KVCacheQuantizer", "attention_modules", "kv_cache_args", "kv_cache_scheme_of"]

_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_b_proj", "c_attn")
#: what transformers calls the attention's cache argument: ``cache`` from 5.2x, before that
#: ``past_key_values`` (and ``past_key_value`` in 4.x)
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")


def _cache_keyword(module: nn.Module) -> str | None:
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _CACHE_KEYWORDS if k in parameters), None)


def kv_cache_args(data: dict[str, Any] | QuantizationArgs) -> QuantizationArgs:
    """A ``kv_cache_scheme`` as compressed-tensors writes it, checked: static, symmetric fp8 per
    tensor or per head."""
    args = data if isinstance(data, QuantizationArgs) else QuantizationArgs(**{"strategy": "tensor", **data})
    problems = []
    if not args.is_float:
        problems.append(f"type={args.type!r} (vLLM runs an fp8 KV cache only)")
    if args.num_bits != 8:
        problems.append(f"num_bits={args.num_bits}")
    if args.dynamic:
        problems.append("dynamic=True")
    if not args.symmetric:
        problems.append("symmetric=False")
    if args.strategy not in (QuantizationStrategy.TENSOR, QuantizationStrategy.ATTN_HEAD):
        problems.append(f"strategy={args.strategy!r}")
    if problems:
        raise SchemeError(
            "this kv_cache_scheme cannot be applied",
            got=", ".join(problems),
            expected="num_bits: 8, type: float, strategy: tensor or attn_head, dynamic: false, symmetric: true",
            fix="use kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}",
        )
    return args


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules whose keys and values go through a transformers ``Cache``."""
    found = {}
    for name, module in model.named_modules():
        if "attention" not in type(module).__name__.lower() or not any(hasattr(module, p) for p in _PROJECTIONS):
            continue
        if _cache_keyword(module) is not None:
            found[name] = module
    return found


def kv_cache_scheme_of(model: nn.Module) -> QuantizationArgs | None:
    """The ``kv_cache_scheme`` the model's attention modules carry (None when none does)."""
    for module in model.modules():
        quantizer = KVCacheQuantizer.of(module)
        if quantizer is not None and quantizer.frozen:
            return quantizer.args
    return None


class _StandInCache:
    """What the attention module sees as its cache: it quantizes (or observes) on ``update`` and
    hands everything else to the real cache."""

    def __init__(self, quantizer: KVCacheQuantizer, module: nn.Module, inner: Any) -> None:
        self.__dict__.update(quantizer=quantizer, module=module, inner=inner)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        key_states, value_states = self.quantizer.process(self.module, key_states, value_states)
        if self.inner is None:
            return key_states, value_states
        return self.inner.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class KVCacheQuantizer:
    """One attention module's KV quantization: observing until ``freeze``, quantizing after."""

    def __init__(self, module: nn.Module, args: QuantizationArgs) -> None:
        self.args = args
        self.frozen = False
        self.observing = False
        self.absmax: dict[str, torch.Tensor] = {}
        self.keyword = _cache_keyword(module)
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)
        state_of(module).kv_cache = self

    @classmethod
    def attach(cls, module: nn.Module, args: QuantizationArgs) -> KVCacheQuantizer:
        existing = KVCacheQuantizer.of(module)
        if existing is not None:
            existing.args = args
            return existing
        return cls(module, args)

    @staticmethod
    def of(module: nn.Module) -> KVCacheQuantizer | None:
        state = existing_state(module)
        return None if state is None else state.kv_cache

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if not (self.observing or self.frozen):
            return None
        keyword = next((k for k in _CACHE_KEYWORDS if k in kwargs), self.keyword)  # as the caller named it
        inner = kwargs.get(keyword)
        if hasattr(inner, "self_attention_cache"):  # an encoder-decoder cache: not handled, left as it is
            return None
        kwargs[keyword] = _StandInCache(self, module, inner)
        return args, kwargs

    def _reduce(self, states: torch.Tensor) -> torch.Tensor:
        """|states| ``[batch, heads, tokens, head_dim]`` at its largest, per tensor or per head."""
        magnitude = states.detach().abs().float()
        if self.args.strategy == QuantizationStrategy.ATTN_HEAD:
            return magnitude.amax(dim=(0, 2, 3))
        return magnitude.amax().reshape(1)

    def process(self, module: nn.Module, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.observing:
            for name, states in (("k", key_states), ("v", value_states)):
                seen = self._reduce(states)
                if name in self.absmax:  # seen before, maybe on another device (the block moved to a GPU)
                    seen = torch.maximum(self.absmax[name].to(seen.device), seen)
                self.absmax[name] = seen
        if not self.frozen:
            return key_states, value_states
        return fake_quantize(key_states, module.k_scale, None, self.args), fake_quantize(value_states, module.v_scale, None, self.args)

    def scale_shape(self, num_heads: int) -> tuple[int, ...]:
        return (num_heads, 1, 1) if self.args.strategy == QuantizationStrategy.ATTN_HEAD else (1,)

    def freeze(self, module: nn.Module, dtype: torch.dtype) -> bool:
        """Set the scales from what was observed and quantize from now on; False when nothing was
        observed (the attention never updated a cache)."""
        self.observing = False
        if set(self.absmax) != {"k", "v"}:
            return False
        for name in ("k", "v"):
            absmax = self.absmax.pop(name)
            scale, _ = compute_qparams(-absmax, absmax, self.args)  # absmax / 448
            scale = scale.reshape(self.scale_shape(absmax.numel()))
            set_module_buffer(module, f"{name}_scale", scale.to(dtype))
        self.frozen = True
        return True

    def expect_scales(self, module: nn.Module, num_heads: int, dtype: torch.dtype) -> None:
        """Scales for a checkpoint to fill (loading; on ``meta``, so a checkpoint without them is
        reported missing), quantizing from then on."""
        for name in ("k", "v"):
            set_module_buffer(module, f"{name}_scale", torch.empty(self.scale_shape(num_heads), dtype=dtype, device="meta"))
        self.frozen = True

    def detach(self, module: nn.Module) -> None:
        self.handle.remove()
        for name in ("k_scale", "v_scale"):
            set_module_buffer(module, name, None)
        state_of(module).kv_cache = None
        forget_state_if_empty(module)

