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
    "DynamicType",
    "QuantizationType",
    "QuantizationStrategy",
    "ActivationOrdering",
    "QuantizationArgs",
    "QuantizationScheme",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
FP4_E2M1_MAX = 6.0
#: the scale dtypes compressed-tensors writes (as "torch.<name>"); any torch dtype is read
SCALE_DTYPES = ("float8_e4m3fn", "uint8", "bfloat16", "float16", "float32")
OBSERVERS = ("minmax", "mse", "static_minmax", "memoryless_minmax", "memoryless_mse")


class QuantizationType(str, Enum):
    INT = "int"
    FLOAT = "float"


class QuantizationStrategy(str, Enum):
    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    TOKEN = "token"
    BLOCK = "block"  # one scale per block_structure [rows, cols] tile of a weight (FP8_BLOCK)
    TENSOR_GROUP = "tensor_group"  # group scales relative to one global scale per tensor (NVFP4)
    ATTN_HEAD = "attn_head"  # one scale per attention head: KV-cache quantization only


class DynamicType(str, Enum):
    LOCAL = "local"  # NVFP4 inputs: group scales computed at run time against a calibrated global scale


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
    dynamic: bool | DynamicType = False
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

    @field_validator("scale_dtype", "zp_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """``torch.float8_e4m3fn``, ``"torch.float8_e4m3fn"`` or ``"float8_e4m3fn"``: kept as
        compressed-tensors writes it (``"torch.float8_e4m3fn"``)."""
        if value is None:
            return None
        name = str(value).removeprefix("torch.")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise SchemeError(
                f"unknown scale dtype {value!r}",
                got=value,
                expected=f"a torch dtype, e.g. {', '.join(f'torch.{n}' for n in SCALE_DTYPES)}",
                fix="use torch.float8_e4m3fn (NVFP4), torch.uint8 (MX formats) or leave it out",
            )
        return f"torch.{name}"

    @field_validator("dynamic", mode="before")
    @classmethod
    def _dynamic_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("block_structure", mode="before")
    @classmethod
    def _block_string(cls, value: Any) -> Any:
        """compressed-tensors' older string form ``"128x128"``."""
        if isinstance(value, str) and "x" in value:
            try:
                return [int(part) for part in value.split("x")]
            except ValueError:
                return value
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
        if self.type == QuantizationType.FLOAT and self.num_bits not in (4, 8):
            raise SchemeError(
                "invalid num_bits for type='float'",
                got=self.num_bits,
                expected="8 (float8_e4m3fn) or 4 (fp4 e2m1)",
                fix="use num_bits=8 or 4 with type='float', or type='int' for other widths",
            )
        if self.type == QuantizationType.FLOAT and not self.symmetric:
            raise SchemeError(
                "float quantization must be symmetric",
                got="symmetric=False",
                expected="symmetric=True",
                fix="set symmetric: true, or use type='int' for asymmetric quantization",
            )
        self._infer_strategy()
        if (self.block_structure is not None) != (self.strategy == QuantizationStrategy.BLOCK):
            raise SchemeError(
                "block_structure and strategy='block' go together",
                got=f"strategy={self.strategy!r}, block_structure={self.block_structure}",
                expected="strategy: block with block_structure: [rows, cols] (e.g. [128, 128]), or neither",
                fix="set both, or remove block_structure",
            )
        if self.block_structure is not None and (len(self.block_structure) != 2 or min(self.block_structure) < 1):
            raise SchemeError("block_structure is [rows, cols] of a weight tile", got=self.block_structure,
                              expected="two positive sizes, e.g. [128, 128]", fix="use block_structure: [128, 128]")
        self._check_microscaling()
        if self.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP) and (not self.group_size or self.group_size < 1):
            raise SchemeError(
                f"invalid group size {self.group_size}",
                got=f"group_size={self.group_size}",
                expected="group_size > 0 for strategy='group'",
                fix="use group_size > 0 for strategy='group' (e.g. 128), or strategy='channel'",
            )
        if not self.is_grouped and self.group_size not in (None, -1):
            raise SchemeError(
                f"group_size={self.group_size} only applies to strategy='group' or 'tensor_group'",
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

    def _check_microscaling(self) -> None:
        """fp4 weights come in two layouts: NVFP4 (tensor_group, 16) and MX (group, 32, e8m0
        scales), fp8 in MX's too; ``dynamic: local`` belongs to tensor_group."""
        if self.dynamic == DynamicType.LOCAL and self.strategy != QuantizationStrategy.TENSOR_GROUP:
            raise SchemeError("dynamic: local applies to strategy 'tensor_group' only", got=f"strategy={self.strategy!r}",
                              expected="strategy: tensor_group (NVFP4 inputs)", fix="use dynamic: true for other strategies")
        if self.strategy == QuantizationStrategy.TENSOR_GROUP and not (self.is_float and self.num_bits == 4):
            raise SchemeError("strategy 'tensor_group' is NVFP4's: fp4 values", got=f"type={self.type!r}, num_bits={self.num_bits}",
                              expected="type: float, num_bits: 4", fix="use strategy 'group' for other types")
        if self.scale_dtype == "torch.uint8" and not (self.is_float and self.strategy == QuantizationStrategy.GROUP
                                                      and self.group_size == 32):
            raise SchemeError(
                "power-of-two (uint8, e8m0) scales are the MX formats': fp4 or fp8 values in groups of 32",
                got=f"type={self.type!r}, num_bits={self.num_bits}, strategy={self.strategy!r}, group_size={self.group_size}",
                expected="type: float, num_bits: 4 or 8, strategy: group, group_size: 32",
                fix="use the MXFP4A16, MXFP4, MXFP8A16 or MXFP8 preset (llmpress does not write MXFP6)",
            )
        if self.is_float and self.num_bits == 4 and not (self.is_mx or (self.strategy == QuantizationStrategy.TENSOR_GROUP
                                                                         and self.group_size == 16)):
            raise SchemeError(
                "fp4 values need NVFP4's or MXFP4's scales",
                got=f"strategy={self.strategy!r}, group_size={self.group_size}, scale_dtype={self.scale_dtype}",
                expected="strategy: tensor_group, group_size: 16 (NVFP4), or strategy: group, group_size: 32, "
                         "scale_dtype: torch.uint8 (MXFP4)",
                fix="use the NVFP4A16, NVFP4, MXFP4A16 or MXFP4 preset",
            )

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
    def is_fp4(self) -> bool:
        return self.is_float and self.num_bits == 4

    @property
    def is_mx(self) -> bool:
        """Power-of-two group scales stored as uint8 exponents (OCP microscaling: MXFP4, MXFP8)."""
        return self.scale_dtype == "torch.uint8"

    @property
    def is_grouped(self) -> bool:
        """Scales per group of ``group_size`` columns (``group``, and NVFP4's ``tensor_group``)."""
        return self.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)

    @property
    def has_global_scale(self) -> bool:
        """NVFP4: fp8 group scales relative to one fp32 global scale per tensor."""
        return self.strategy == QuantizationStrategy.TENSOR_GROUP

    @property
    def observes_range(self) -> bool:
        """Whether calibration data sets something of this (input) quantization: a static scale,
        or NVFP4's global scale beside its dynamic group scales."""
        return not self.dynamic or self.dynamic == DynamicType.LOCAL

    @property
    def q_range(self) -> tuple[float, float]:
        """Smallest and largest representable quantized value."""
        if self.is_fp4:
            return -FP4_E2M1_MAX, FP4_E2M1_MAX
        if self.is_float:
            return -FP8_E4M3_MAX, FP8_E4M3_MAX
        return float(-(2 ** (self.num_bits - 1))), float(2 ** (self.num_bits - 1) - 1)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype quantized values are held in: int8 (integers), float8_e4m3fn, or (fp4)
        float32 holding grid values until a format packs them."""
        if self.is_fp4:
            return torch.float32
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
