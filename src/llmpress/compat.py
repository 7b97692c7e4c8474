"""Other libraries' private parts, in one place.

llmpress reads a few things transformers and torch do not publish: how transformers renames and
fuses checkpoint tensors on load (its conversion mapping), a fused-experts module's gate, the
marks its loader and its compiled ``generate`` read, torch's tensor version counters, a module's
own parameter and buffer slots, and Inductor's compiler probe. Each is reached only through a
function here, so that a new release that moves one breaks one place, and each says what it
does where the part is missing.

Checked against (``CHECKED``): transformers 5.17 (llm-compressor 0.14's pin) to 5.25, and torch
2.4 to 2.13. transformers 4 has no conversion mapping and no ``ConversionOps`` loading: the
functions below then answer as for a model without renamings, and the transformers adapter is
not registered.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHECKED",
    "apply_gate",
    "compile_config",
    "conversion_mapping",
    "conversion_ops_base",
    "converter_patterns",
    "cpp_compiler_available",
    "is_converter",
    "is_prefix_change",
    "is_renaming",
    "mark_loaded",
    "own_buffers",
    "own_parameters",
    "previous_cache_length",
    "register_with_transformers",
    "tensor_version",
    "unregister_from_transformers",
]

logger = logging.getLogger(__name__)

#: the versions each private part was checked against
CHECKED = {"transformers": "5.17 - 5.25", "torch": "2.4 - 2.13"}


# -- transformers: how checkpoint tensors are renamed and fused on load -------------------------
@functools.cache
def _loading_classes() -> tuple[type, type, type, type] | None:
    """``(WeightRenaming, PrefixChange, WeightConverter, ConversionOps)`` from
    ``transformers.core_model_loading``, or None (transformers 4)."""
    try:
        from transformers.core_model_loading import ConversionOps, PrefixChange, WeightConverter, WeightRenaming
    except ImportError:
        return None
    return WeightRenaming, PrefixChange, WeightConverter, ConversionOps


def conversion_mapping(model: nn.Module, *, add_legacy: bool) -> list:
    """transformers' renamings and conversions of ``model``'s checkpoint tensors
    (``get_model_conversion_mapping``); empty where there are none, transformers 4 included."""
    if _loading_classes() is None:
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    try:
        return list(get_model_conversion_mapping(model, add_legacy=add_legacy))
    except Exception as exc:  # noqa: BLE001 - a model whose mapping transformers cannot build: names as they are
        logger.debug("no conversion mapping for %s: %s", type(model).__name__, exc)
        return []


def is_renaming(conversion: Any) -> bool:
    classes = _loading_classes()
    return classes is not None and isinstance(conversion, classes[0])


def is_prefix_change(conversion: Any) -> bool:
    classes = _loading_classes()
    return classes is not None and isinstance(conversion, classes[1])


def is_converter(conversion: Any) -> bool:
    classes = _loading_classes()
    return classes is not None and isinstance(conversion, classes[2])


def converter_patterns(converter: Any) -> tuple[list[str], list[str]]:
    """A ``WeightConverter``'s source and target key patterns, as the model class wrote them."""
    return list(converter._original_source_patterns), list(converter._original_target_patterns)


def conversion_ops_base() -> type | None:
    """transformers' ``ConversionOps`` (a quantizer's per-tensor hook), or None (transformers 4)."""
    classes = _loading_classes()
    return None if classes is None else classes[3]


def mark_loaded(tensor: torch.Tensor) -> None:
    """Tell transformers' loader that ``tensor`` was read from the checkpoint, so it does not
    initialise it afterwards."""
    tensor._is_hf_initialized = True


def apply_gate(experts: nn.Module, joined: torch.Tensor) -> torch.Tensor:
    """A fused-experts module's activation of its gate and up products (``joined``, side by side)."""
    return experts._apply_gate(joined)


# -- transformers: registration of a quantization method ------------------------------------------
def register_with_transformers(method: str, config: type, quantizer: type) -> bool:
    """``from_pretrained(..., quantization_config=config(...))`` loads through ``quantizer``
    (transformers' public ``register_quantization_config`` / ``register_quantizer``). False where
    transformers has the method itself or cannot take one (transformers 4)."""
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer
    except ImportError:
        return False
    if method in AUTO_QUANTIZER_MAPPING:
        return False
    register_quantization_config(method)(config)
    register_quantizer(method)(quantizer)
    return True


def unregister_from_transformers(method: str, quantizer: type) -> None:
    """Undo ``register_with_transformers`` (transformers has no public way: its two mappings)."""
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    except ImportError:
        return
    if AUTO_QUANTIZER_MAPPING.get(method) is quantizer:
        del AUTO_QUANTIZER_MAPPING[method]
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(method, None)


# -- transformers: compiled generate ------------------------------------------------------------
def compile_config() -> Any:
    """transformers' ``CompileConfig`` for a compiled decode step, told to compile on the CPU too
    (transformers compiles on accelerators only unless told)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config


def previous_cache_length(model: nn.Module) -> int:
    """The largest static cache ``generate`` built for ``model`` so far (-1 for none): transformers
    keeps it for later calls."""
    return getattr(model, "_previous_max_cache_length", -1)


# -- torch ------------------------------------------------------------------------------------
def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it changes with every in-place write through torch."""
    return tensor._version


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots, by name (``None`` for an unset one such as a missing
    bias): the live mapping, which a caller may change (set, replace or remove a slot)."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer slots, by name: the live mapping, as ``own_parameters``."""
    return module._buffers


@functools.cache
def cpp_compiler_available() -> bool:
    """Whether Inductor finds a C++ compiler (its CPU backend needs one)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
        return True
    except Exception:  # noqa: BLE001 - no compiler, or another torch
        return False
