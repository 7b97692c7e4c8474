"""Quantization schemes in the compressed-tensors JSON vocabulary.

``QuantizationArgs`` says how one tensor is quantized (bits, int/float, symmetric, strategy,
group size, dynamic, observer...). ``QuantizationScheme`` says which modules get which args for
their weights and activations. Both read and write the exact JSON that compressed-tensors and
vLLM use, and refuse bad combinations with a message that says how to fix them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmpress.errors import SchemeError

__all__ = [
    "QuantizationType",
    "QuantizationStrategy",
    "ActivationOrdering",
    "QuantizationArgs",
    "QuantizationScheme",
    "PRESET_SCHEMES",
    "preset_scheme",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
OBSERVERS = ("minmax", "mse", "static_minmax", "memoryless_minmax", "memoryless_mse")


class QuantizationType(str, Enum):
    INT = "int"
    FLOAT = "float"


class QuantizationStrategy(str, Enum):
    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    TOKEN = "token"
    ATTN_HEAD = "attn_head"  # one scale per attention head: KV-cache quantization only


class ActivationOrdering(str, Enum):
    GROUP = "group"
    WEIGHT = "weight"
    STATIC = "static"


class QuantizationArgs(BaseModel):
    """How one tensor (a weight, or a module's input) is quantized."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True, validate_assignment=False)

    num_bits: int = 8
    type: QuantizationType = QuantizationType.INT
    symmetric: bool = True
    group_size: int | None = None
    strategy: QuantizationStrategy | None = None
    block_structure: list[int] | None = None
    dynamic: bool = False
    actorder: ActivationOrdering | None = None
    scale_dtype: Any | None = None
    zp_dtype: Any | None = None
    observer: str | None = Field(default=None)
    observer_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("actorder", mode="before")
    @classmethod
    def _actorder_bool(cls, value: Any) -> Any:
        if value is True:
            return ActivationOrdering.GROUP
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _check(self) -> QuantizationArgs:
        if self.type == QuantizationType.INT and not 1 <= self.num_bits <= 8:
            raise SchemeError(
                "invalid num_bits for type='int'",
                got=self.num_bits,
                expected="1 <= num_bits <= 8",
                fix="use num_bits=4 or num_bits=8 for integer quantization",
            )
        if self.type == QuantizationType.FLOAT and self.num_bits != 8:
            raise SchemeError(
                "invalid num_bits for type='float'",
                got=self.num_bits,
                expected="8 (float8_e4m3fn)",
                fix="use num_bits=8 with type='float', or type='int' for other widths",
            )
        if self.type == QuantizationType.FLOAT and not self.symmetric:
            raise SchemeError(
                "float quantization must be symmetric",
                got="symmetric=False",
                expected="symmetric=True",
                fix="set symmetric: true, or use type='int' for asymmetric quantization",
            )
        if self.block_structure is not None:
            raise SchemeError(
                "block quantization is not supported yet",
                got=f"block_structure={self.block_structure}",
                expected="block_structure=null",
                fix="use strategy 'group' or 'channel'",
            )
        self._infer_strategy()
        if self.strategy == QuantizationStrategy.GROUP and (not self.group_size or self.group_size < 1):
            raise SchemeError(
                f"invalid group size {self.group_size}",
                got=f"group_size={self.group_size}",
                expected="group_size > 0 for strategy='group'",
                fix="use group_size > 0 for strategy='group' (e.g. 128), or strategy='channel'",
            )
        if self.strategy != QuantizationStrategy.GROUP and self.group_size not in (None, -1):
            raise SchemeError(
                f"group_size={self.group_size} only applies to strategy='group'",
                got=f"strategy={self.strategy!r}",
                expected="strategy='group'",
                fix="set strategy: group, or remove group_size",
            )
        if self.strategy == QuantizationStrategy.TOKEN and not self.dynamic:
            raise SchemeError(
                "strategy='token' needs dynamic=True: a per-token scale can only be computed at run time",
                got="dynamic=False",
                expected="dynamic=True",
                fix="set dynamic: true, or use strategy 'tensor' for static activation scales",
            )
        if self.observer is not None and self.observer not in OBSERVERS:
            raise SchemeError(
                f"unknown observer {self.observer!r}",
                got=self.observer,
                expected=f"one of {', '.join(OBSERVERS)}",
                fix="use observer: minmax (or mse for weights)",
            )
        return self  # observer None: the modifier's default (minmax for RTN, mse for GPTQ)

    def _infer_strategy(self) -> None:
        if self.group_size == -1:
            self.group_size = None
            self.strategy = self.strategy or QuantizationStrategy.CHANNEL.value
        if self.strategy is None:
            self.strategy = (QuantizationStrategy.GROUP if self.group_size else QuantizationStrategy.TENSOR).value

    # -- derived facts -------------------------------------------------------------------
    @property
    def is_float(self) -> bool:
        return self.type == QuantizationType.FLOAT

    @property
    def q_range(self) -> tuple[float, float]:
        """Smallest and largest representable quantized value."""
        if self.is_float:
            return -FP8_E4M3_MAX, FP8_E4M3_MAX
        return float(-(2 ** (self.num_bits - 1))), float(2 ** (self.num_bits - 1) - 1)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.is_float else torch.int8

    @property
    def uses_mse(self) -> bool:
        return bool(self.observer and "mse" in self.observer)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class QuantizationScheme(BaseModel):
    """Which modules (``targets``) get which quantization for weights and activations."""

    model_config = ConfigDict(extra="forbid")

    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    weights: QuantizationArgs | None = None
    input_activations: QuantizationArgs | None = None
    output_activations: QuantizationArgs | None = None
    format: str | None = None

    @model_validator(mode="after")
    def _check(self) -> QuantizationScheme:
        for field in ("weights", "input_activations"):
            args = getattr(self, field)
            if args is not None and args.strategy == QuantizationStrategy.ATTN_HEAD:
                raise SchemeError(
                    f"strategy 'attn_head' applies to the KV cache only, not to {field}",
                    got=f"{field}.strategy='attn_head'",
                    expected="'tensor', 'channel', 'group' or 'token'",
                    fix="put per-head scales in kv_cache_scheme",
                )
        if self.weights is not None:
            if self.weights.dynamic:
                raise SchemeError(
                    "weights cannot be quantized dynamically",
                    got="weights.dynamic=True",
                    expected="weights.dynamic=False",
                    fix="remove dynamic from the weights section",
                )
        if self.output_activations is not None:
            raise SchemeError(
                "output activation quantization is not supported",
                got=self.output_activations.to_json(),
                expected="output_activations: null",
                fix="quantize weights and input activations only",
            )
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _args(**kw: Any) -> dict[str, Any]:
    return kw


PRESET_SCHEMES: dict[str, dict[str, Any]] = {
    "W4A16": {"weights": _args(num_bits=4, symmetric=True, strategy="group", group_size=128)},
    "W4A16_ASYM": {"weights": _args(num_bits=4, symmetric=False, strategy="group", group_size=128)},
    "W8A16": {"weights": _args(num_bits=8, symmetric=True, strategy="group", group_size=128)},
    "W8A8": {
        "weights": _args(num_bits=8, symmetric=True, strategy="channel"),
        "input_activations": _args(num_bits=8, symmetric=True, strategy="token", dynamic=True),
    },
    "FP8": {
        "weights": _args(num_bits=8, type="float", strategy="tensor"),
        "input_activations": _args(num_bits=8, type="float", strategy="tensor", observer="minmax"),
    },
    "FP8_DYNAMIC": {
        "weights": _args(num_bits=8, type="float", strategy="channel"),
        "input_activations": _args(num_bits=8, type="float", strategy="token", dynamic=True),
    },
}


def preset_scheme(name: str, targets: list[str] | None = None) -> QuantizationScheme:
    """The scheme for a preset name (``W4A16``, ``W8A8``, ``FP8``...), aimed at ``targets``."""
    key = name.upper()
    if key not in PRESET_SCHEMES:
        import difflib

        close = difflib.get_close_matches(key, list(PRESET_SCHEMES), n=1)
        raise SchemeError(
            f"unknown preset scheme {name!r}",
            got=name,
            expected=f"one of {', '.join(PRESET_SCHEMES)}",
            fix=f"did you mean {close[0]!r}?" if close else "use one of the preset names",
        )
    return QuantizationScheme(targets=list(targets or ["Linear"]), **PRESET_SCHEMES[key])
