"""Quantization methods: the enum of the built-in ones and their config classes (each method's
config and quantizer are registered together in ``methods.py``).

A config is a transformers ``QuantizationConfigMixin`` (so the same object also works in
``AutoModelForCausalLM.from_pretrained(..., quantization_config=...)``), built from its
``config.json`` entry with ``from_dict`` and checked on construction with clear errors.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from llmpress.errors import CheckpointError, RecipeError
from llmpress.quant.scheme import QuantizationScheme

if TYPE_CHECKING:
    pass

__all__ = ["CompressedTensorsConfig", "LlmpressConfig", "QuantizationConfig", "QuantizationMethod", "method_name"]


class QuantizationMethod(str, Enum):
    """The built-in methods (the ``quant_method`` of a ``quantization_config``). Plugins register
    further methods by name."""

    COMPRESSED_TENSORS = "compressed-tensors"
    LLMPRESS = "llmpress"


def method_name(method: str | QuantizationMethod) -> str:
    """The registry name of a method (an enum member's value, or the string itself)."""
    return method.value if isinstance(method, QuantizationMethod) else str(method)


class QuantizationConfig(QuantizationConfigMixin):
    """Base of every method's config: ``quant_method`` plus the method's own fields."""

    quant_method: str = ""

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        data = {k: v for k, v in config_dict.items() if k != "quant_method"}
        return super().from_dict(data, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": method_name(self.quant_method), **{k: v for k, v in super().to_dict().items() if not k.startswith("_")}}


class CompressedTensorsConfig(QuantizationConfig):
    """A checkpoint in the compressed-tensors format (written by llmpress or llm-compressor).

    ``dequantize=True`` loads dense weights on their quantization grid (exactly what
    compressed-tensors computes in full precision) instead of the compressed runtime modules.
    """

    quant_method = QuantizationMethod.COMPRESSED_TENSORS.value

    def __init__(self, config_groups: dict[str, Any] | None = None, *, dequantize: bool = False, **fields: Any) -> None:
        self.config_groups = dict(config_groups or {})
        self.format = fields.pop("format", None)
        self.quantization_status = fields.pop("quantization_status", "compressed")
        self.ignore = list(fields.pop("ignore", None) or [])
        self.kv_cache_scheme = fields.pop("kv_cache_scheme", None)
        self.dequantize = dequantize
        self._other = fields  # sparsity_config, version, global_compression_ratio...: carried, not used

    def schemes(self) -> list:
        out = []
        for name, group in self.config_groups.items():
            try:
                out.append(QuantizationScheme(**{**group, "format": group.get("format") or self.format}))
            except RecipeError as exc:
                raise CheckpointError(
                    f"config group {name!r} of the checkpoint is not a scheme llmpress can load",
                    got=exc.got or str(exc),
                    expected=exc.expected or "a compressed-tensors scheme",
                ) from None
        return out


class LlmpressConfig(QuantizationConfig):
    """Quantize a full-precision checkpoint while it loads: int4 or int8 weights, RTN.

    ``group_size`` is the number of input columns sharing one scale; ``None`` means one scale per
    output channel. The default is 128 for 4 bits and per-channel for 8 bits, where the int8 CPU
    kernel applies (grouped int8 runs, but through on-the-fly dequantization). ``ignore`` lists
    modules to keep in full precision (names, ``re:`` patterns or class names); by default the
    output projection ``lm_head``. ``lm_head=True`` quantizes it too, as llama.cpp does: the
    largest single product of a decode step (a quarter of the time of a small model); with
    tied embeddings it becomes a quantized copy beside the embedding.
    """

    quant_method = QuantizationMethod.LLMPRESS.value

    def __init__(
        self,
        bits: int = 4,
        group_size: int | None | str = "default",
        ignore: list[str] | None = None,
        symmetric: bool = True,
        lm_head: bool = False,
        **unused: Any,
    ) -> None:
        if bits not in (4, 8):
            raise RecipeError("LlmpressConfig.bits must be 4 or 8", got=bits, expected="4 | 8")
        if group_size == "default":
            group_size = 128 if bits == 4 else None
        if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
            raise RecipeError(
                "LlmpressConfig.group_size must be a positive integer or None",
                got=group_size,
                expected="e.g. 128, or None for one scale per output channel",
            )
        self.bits = bits
        self.group_size = group_size
        self.ignore = list(([] if lm_head else ["lm_head"]) if ignore is None else ignore)
        self.lm_head = bool(lm_head)
        self.symmetric = bool(symmetric)

    def scheme(self):
        weights: dict[str, Any] = {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric}
        if self.group_size is None:
            weights["strategy"] = "channel"
        else:
            weights.update(strategy="group", group_size=self.group_size)
        return QuantizationScheme(targets=["Linear"], weights=weights)
