"""``Quantizer``: what a quantization method plugs into the loader.

The loader (``llmpress.load``) never branches on the method; it calls these methods in a fixed
order (``docs/loading.md``). Public methods do the bookkeeping and call the ``_hooks`` a subclass
overrides; every hook has a harmless default, so a method overrides only what it needs:

1. ``validate_environment`` 2. ``update_dtype`` 3. ``update_device_map`` / ``adjust_max_memory``
4. (loader builds the skeleton, parameters on ``meta``)
5. ``process_model_before_weight_loading``: swap in quantized modules
6. per checkpoint tensor: ``param_needs_quantization`` → ``create_quantized_param``, else the
   loader copies it as it is
7. ``update_missing_keys`` / ``update_unexpected_keys``
8. ``process_model_after_weight_loading``
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.checkpoint.save_pretrained import route_save_pretrained
from llmpress.loading.config import QuantizationConfig
from llmpress.loading.dense import dequantize_model

__all__ = ["Quantizer"]


class Quantizer:
    """Base class. ``pre_quantized`` says whether the checkpoint is already compressed (loading)
    or full precision (quantize-on-load)."""

    #: whether a model must be calibrated before this method can produce it (no quantize-on-load)
    requires_calibration: bool = False

    def __init__(self, config: QuantizationConfig, *, pre_quantized: bool) -> None:
        self.config = config
        self.pre_quantized = pre_quantized
        self.checkpoint_keys: frozenset[str] = frozenset()
        self.quantized_modules: list[str] = []

    # -- 1..3: before the model exists -------------------------------------------------------
    def validate_environment(self, *, device_map: Any = None) -> None:
        """Raise a clear error when this method cannot run here (missing package, kernel, device)."""
        return None

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype of the model's unquantized parts; ``None`` keeps the checkpoint's."""
        return dtype

    def update_device_map(self, device_map: Any) -> Any:
        return device_map

    def adjust_max_memory(self, max_memory: dict[Any, int] | None) -> dict[Any, int] | None:
        """Room to keep free on each device (e.g. for unpacking buffers) when placing modules."""
        return max_memory

    # -- 5: the skeleton ---------------------------------------------------------------------
    def process_model_before_weight_loading(self, model: nn.Module, *, checkpoint_keys: set[str]) -> None:
        self.checkpoint_keys = frozenset(checkpoint_keys)
        self._process_model_before_weight_loading(model)

    def _process_model_before_weight_loading(self, model: nn.Module) -> None:
        return None

    # -- 6: each tensor ----------------------------------------------------------------------
    def param_needs_quantization(self, model: nn.Module, param_name: str) -> bool:
        """Whether ``param_name`` goes through ``create_quantized_param`` (else a plain copy)."""
        return False

    def create_quantized_param(self, model: nn.Module, param_name: str, tensor: torch.Tensor, device: torch.device) -> None:
        """Put the checkpoint tensor ``param_name`` into the model, quantized or compressed."""
        raise NotImplementedError(f"{type(self).__name__} quantizes parameters but has no create_quantized_param")

    # -- 7..8: after streaming ---------------------------------------------------------------
    def update_missing_keys(self, model: nn.Module, missing: list[str]) -> list[str]:
        """Drop the names this method fills itself from the list of missing weights."""
        return missing

    def update_unexpected_keys(self, model: nn.Module, unexpected: list[str]) -> list[str]:
        return unexpected

    def process_model_after_weight_loading(self, model: nn.Module) -> None:
        """The method's last touches, then ``model.save_pretrained`` writes through llmpress's
        save path (a compressed model saves compressed, with its recipe)."""
        self._process_model_after_weight_loading(model)
        route_save_pretrained(model)

    def _process_model_after_weight_loading(self, model: nn.Module) -> None:
        return None

    # -- what the method is ------------------------------------------------------------------
    @property
    def is_serializable(self) -> bool:
        """Whether a model loaded this way saves through ``save_checkpoint``."""
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    def dequantize(self, model: nn.Module) -> nn.Module:
        """Replace the runtime modules with dense ``nn.Linear`` on the quantization grid; the
        scheme stays attached, so the model still saves compressed."""
        return dequantize_model(model)
