"""Scheme names: compressed-tensors' presets (every name llm-compressor's recipes take), and
llmpress's spelling of integer weights at another group size or asymmetric.

``W<bits>A16`` (weights only), ``W<bits>A8`` and ``W<bits>A4`` (int8 / int4 inputs per token,
at run time) and ``W4AFP8`` (fp8 inputs per token) are int weights, symmetric, in groups of 128,
as compressed-tensors defines them; ``INT8`` is ``W8A8``. Beyond compressed-tensors' names,
``_ASYM`` after a scheme of int weights makes them asymmetric and ``_G<size>`` sets their group
(``W4A16_G32``, ``W3A16_ASYM_G64``). A recipe keeps compressed-tensors' names as they are and
writes the others as a config group (``modifiers/quantization/config.py``), so that
llm-compressor reads every recipe llmpress saves.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from llmpress.errors import SchemeError
from llmpress.quant.scheme import QuantizationScheme, QuantizationStrategy

__all__ = ["NAMES_HINT", "NOT_WRITTEN", "PRESET_SCHEMES", "is_preset", "preset_scheme"]


def _args(**kw: Any) -> dict[str, Any]:
    return kw


def _int_weights(bits: int) -> dict[str, Any]:
    return _args(num_bits=bits, symmetric=True, strategy="group", group_size=128)


_INT8_TOKENS = _args(num_bits=8, symmetric=True, strategy="token", dynamic=True)
_INT4_TOKENS = _args(num_bits=4, symmetric=True, strategy="token", dynamic=True)
_NVFP4 = _args(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
_MXFP4 = _args(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="torch.uint8")
_MXFP8 = {**_MXFP4, "num_bits": 8}
_W8A8 = {"weights": _args(num_bits=8, symmetric=True, strategy="channel"), "input_activations": _INT8_TOKENS}

#: compressed-tensors' presets (0.19, llm-compressor 0.14's, and 0.20's MXFP4XFP8), less ``NOT_WRITTEN``'s
PRESET_SCHEMES: dict[str, dict[str, Any]] = {
    "W4A16": {"weights": _int_weights(4)},
    "W4A16_ASYM": {"weights": {**_int_weights(4), "symmetric": False}},
    "W8A16": {"weights": _int_weights(8)},
    "W8A8": _W8A8,
    "INT8": _W8A8,
    "FP8": {
        "weights": _args(num_bits=8, type="float", strategy="tensor"),
        "input_activations": _args(num_bits=8, type="float", strategy="tensor", observer="minmax"),
    },
    "FP8_DYNAMIC": {
        "weights": _args(num_bits=8, type="float", strategy="channel"),
        "input_activations": _args(num_bits=8, type="float", strategy="token", dynamic=True),
    },
    "FP8_BLOCK": {
        "weights": _args(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        "input_activations": _args(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
    },
    "NVFP4A16": {"weights": _NVFP4},
    "NVFP4": {"weights": _NVFP4, "input_activations": {**_NVFP4, "dynamic": "local", "observer": "static_minmax"}},
    "MXFP4A16": {"weights": _MXFP4},
    "MXFP4": {"weights": _MXFP4, "input_activations": {**_MXFP4, "dynamic": True}},
    "MXFP4XFP8": {"weights": _MXFP4, "input_activations": _args(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True)},
    "MXFP8A16": {"weights": _MXFP8},
    "MXFP8": {"weights": _MXFP8, "input_activations": {**_MXFP8, "dynamic": True}},
    "W4AFP8": {"weights": _int_weights(4), "input_activations": _args(num_bits=8, type="float", strategy="token", dynamic=True)},
    **{f"W{bits}A16": {"weights": _int_weights(bits)} for bits in range(2, 8)},
    **{f"W{bits}A8": {"weights": _int_weights(bits), "input_activations": _INT8_TOKENS} for bits in range(2, 8)},
    **{f"W{bits}A4": {"weights": _int_weights(bits), "input_activations": _INT4_TOKENS} for bits in range(2, 5)},
}

#: compressed-tensors' names llmpress does not write: why, and what to write instead
NOT_WRITTEN: dict[str, tuple[str, str]] = {
    "UNQUANTIZED": ("it quantizes nothing", "name the modules to leave as they are in ignore"),
    **{name: ("llmpress writes microscaling (MX) formats of fp4 and fp8 values only", "use MXFP4A16 / MXFP4 or MXFP8A16 / MXFP8")
       for name in ("MXFP6A16", "MXFP6A8")},
}

#: the names in a few words, for help texts and errors
NAMES_HINT = "W4A16, W8A8, FP8_DYNAMIC, NVFP4, ... (compressed-tensors' presets), W4A16_G32 (another group)"

_SUFFIXES = re.compile(r"(?P<base>.+?)(?P<asym>_ASYM)?(?:_G(?P<group>\d+))?")


def preset_scheme(name: str, targets: list[str] | None = None) -> QuantizationScheme:
    """The scheme ``name`` says (a preset, with ``_ASYM`` / ``_G<size>`` where its weights are
    int: see the module's docstring), aimed at ``targets``."""
    key = str(name).strip().upper()
    targets = list(targets or ["Linear"])
    if key in PRESET_SCHEMES:
        return QuantizationScheme(targets=targets, **PRESET_SCHEMES[key])
    if key in NOT_WRITTEN:
        why, fix = NOT_WRITTEN[key]
        raise SchemeError(f"{name!r} is a compressed-tensors preset that llmpress does not write: {why}", got=name, fix=fix)
    parts = _SUFFIXES.fullmatch(key)
    if parts is None or parts["base"] not in PRESET_SCHEMES or not (parts["asym"] or parts["group"]):
        close = difflib.get_close_matches(key, list(PRESET_SCHEMES), n=1)
        raise SchemeError(
            f"unknown scheme name {name!r}",
            got=name,
            expected=f"a preset ({', '.join(PRESET_SCHEMES)}), or one of int weights with _ASYM and / or _G<group size> "
                     "(W4A16_G32, W3A16_ASYM_G64)",
            fix=f"did you mean {close[0]!r}?" if close else "use a preset name, or a scheme dict",
        )
    fields = dict(PRESET_SCHEMES[parts["base"]])
    weights = dict(fields["weights"])
    if weights.get("type") == "float" or (parts["group"] and weights.get("strategy") != QuantizationStrategy.GROUP.value):
        raise SchemeError(
            f"{name!r} sets a group size or asymmetry on {parts['base']}, whose weights are not int in groups",
            got=name, expected="_ASYM / _G<size> after a scheme of int weights in groups, e.g. W4A16_G32, W4A8_G64",
            fix=f"use {parts['base']} alone, or a scheme dict",
        )
    if parts["asym"]:
        weights["symmetric"] = False
    if parts["group"]:
        weights["group_size"] = int(parts["group"])
    return QuantizationScheme(targets=targets, **{**fields, "weights": weights})


def is_preset(text: str) -> bool:
    """Whether ``text`` is one of compressed-tensors' own preset names (which a recipe keeps as
    a name), not llmpress's spelling of another group or asymmetry."""
    return str(text).strip().upper() in PRESET_SCHEMES
