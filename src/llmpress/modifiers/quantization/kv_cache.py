"""Calibrating a ``kv_cache_scheme`` (the fp8 KV cache), for any quantizing modifier.

The scales come from the keys and values the attention modules cache (after rotary embedding)
on the calibration data: the largest magnitude over all batches, per tensor or per head, divided
by fp8's largest value. Layer by layer, at ``layer_calibrated`` (its weights compressed), each
block runs once more over all its inputs, unobserved, to see the keys and values it will cache,
and switches to the fp8 cache, so the blocks after it are calibrated on what the compressed model
computes (one extra forward of each block; what ran through the block before does not count). Without blocks, the whole-model calibration
forward is observed and the scales are set at ``calibration_end``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError
from llmpress.lifecycle.kv_cache import KVCacheQuantizer, attention_modules, kv_cache_args
from llmpress.models.classes import model_dtype
from llmpress.models.experts import routed_experts_only
from llmpress.parallel.distributed import gather_objects, is_distributed

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["KVCacheCalibration", "kv_cache_calibration"]

logger = logging.getLogger(__name__)


def kv_cache_calibration(model: nn.Module, config: Any, modifier: str) -> KVCacheCalibration | None:
    """The calibration of ``config.kv_cache_scheme`` on ``model``; None when there is none."""
    return None if config.kv_cache_scheme is None else KVCacheCalibration(model, config.kv_cache_scheme, modifier)


class KVCacheCalibration:
    def __init__(self, model: nn.Module, data: dict[str, Any], modifier: str) -> None:
        self.args = kv_cache_args(data)
        self.modifier = modifier
        self.pending = attention_modules(model)
        if not self.pending:
            raise UnsupportedModelError(
                f"{modifier}: kv_cache_scheme found no attention module that caches keys and values",
                got=type(model).__name__,
                expected="attention modules (…Attention) with k_proj / v_proj (or qkv_proj, kv_b_proj, c_attn) whose forward "
                "takes a cache argument (cache, past_key_values): GPT-NeoX, Bloom and Falcon cache through layer_past and "
                "query_key_value",
                fix="remove kv_cache_scheme for this model",
            )
        self.dtype = model_dtype(model)
        for module in self.pending.values():
            KVCacheQuantizer.attach(module, self.args).observing = True

    def layer_calibrated(self, block: CalibrationBlock) -> None:
        """One unobserved pass of the block, its weights compressed, over all its inputs: the
        keys and values it will cache, whatever ran through it before."""
        inside = {n: m for n, m in self.pending.items() if any(m is sub for sub in block.module.modules())}
        if not inside:
            return
        for module in inside.values():
            KVCacheQuantizer.of(module).absmax.clear()
        with torch.no_grad(), routed_experts_only(block.module):
            for batch in block.inputs:
                block.run(block.module, [batch])  # unobserved, one batch at a time
        self._freeze(inside)

    def layer_restored(self, block: CalibrationBlock) -> None:
        """A resumed run put ``block`` back, its cache scales with it: quantize from now on."""
        for name, module in list(self.pending.items()):
            if any(module is sub for sub in block.module.modules()):
                self.pending.pop(name)
                quantizer = KVCacheQuantizer.of(module)
                quantizer.observing = False
                if getattr(module, "k_scale", None) is not None and getattr(module, "v_scale", None) is not None:
                    quantizer.frozen = True
                else:  # the earlier run saw no cache here and left it full precision
                    quantizer.detach(module)

    def calibration_end(self) -> None:
        self._freeze(dict(self.pending))

    def _freeze(self, modules: dict[str, nn.Module]) -> None:
        _reduce_across_ranks(modules)
        missed = []
        for name, module in modules.items():
            self.pending.pop(name)
            quantizer = KVCacheQuantizer.of(module)
            if not quantizer.freeze(module, self.dtype):
                quantizer.detach(module)
                missed.append(name)
        if missed:
            logger.warning("%s: %d attention module(s) never updated a KV cache during calibration and keep a full-precision "
                           "cache: %s", self.modifier, len(missed), ", ".join(missed[:4]))
        elif modules:
            logger.debug("%s: fp8 KV cache scales set for %s", self.modifier, ", ".join(modules))


def _reduce_across_ranks(modules: dict[str, nn.Module]) -> None:
    """Under torch.distributed: each cache's largest magnitudes over every rank's batches."""
    if not is_distributed():
        return
    mine = {name: {k: v.cpu() for k, v in KVCacheQuantizer.of(m).absmax.items()} for name, m in modules.items()}
    everyone = gather_objects(mine)
    for name, module in modules.items():
        quantizer = KVCacheQuantizer.of(module)
        device = next(iter(quantizer.absmax.values())).device if quantizer.absmax else torch.device("cpu")
        for part in ("k", "v"):
            seen = [ranks[name][part] for ranks in everyone if part in ranks[name]]
            if seen:
                quantizer.absmax[part] = torch.stack(seen).amax(dim=0).to(device)
