"""Loading compressed-tensors checkpoints (llmpress's and llm-compressor's).

Each targeted ``nn.Linear`` (or ``Conv1D``, in its own layout) of the skeleton becomes a
``QuantizedLinear`` (or, with ``dequantize=True``, stays a dense module that receives on-grid
weights). An MoE router that is a Linear subclass with a forward of its own (Phi-MoE's, which
returns the routing) keeps its class and receives the on-grid weight in either case. Targets are matched as
compressed-tensors matches them: ``Linear`` is ``nn.Linear``. A module's
stored tensors are gathered as they stream in and converted as soon as the last one arrives, so
at most a few modules' tensors wait at any time.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmpress.checkpoint.sparsity import SPARSITY_KEY
from llmpress.errors import CheckpointError, LlmpressError
from llmpress.lifecycle.kv_cache import KVCacheQuantizer, attention_modules, kv_cache_args
from llmpress.lifecycle.sparsity import mark_sparse_modules
from llmpress.loading.config import CompressedTensorsConfig, QuantizationMethod
from llmpress.loading.dense import dense_linear
from llmpress.loading.methods import register_quantization_method
from llmpress.loading.quantizer import Quantizer
from llmpress.models.classes import model_dtype
from llmpress.models.linear import features, input_major, is_linear
from llmpress.quant.scheme import QuantizationScheme
from llmpress.runtime import QuantizedLinear
from llmpress.targets import assign_by_targets, moe_routers
from llmpress.transforms.config import read_transform_config
from llmpress.transforms.load import StoredTransforms

__all__ = ["CompressedTensorsQuantizer"]

logger = logging.getLogger(__name__)


class _Target:
    __slots__ = ("scheme", "fmt", "in_features", "out_features", "input_major", "dtype", "expected", "pending", "done", "own_forward")

    def __init__(self, linear: nn.Module, scheme: QuantizationScheme, fmt: str, expected: set[str], router: bool = False) -> None:
        self.scheme, self.fmt, self.expected = scheme, fmt, expected
        (self.in_features, self.out_features), self.dtype = features(linear), linear.weight.dtype
        self.input_major = input_major(linear)
        # a router that is a Linear subclass computing the routing: kept, given the dequantized weight
        self.own_forward = router and isinstance(linear, nn.Linear) and type(linear).forward is not nn.Linear.forward
        self.pending: dict[str, torch.Tensor] = {}
        self.done = False


@register_quantization_method(QuantizationMethod.COMPRESSED_TENSORS, config=CompressedTensorsConfig)
class CompressedTensorsQuantizer(Quantizer):
    requires_calibration = True
    config: CompressedTensorsConfig
    transforms: StoredTransforms | None = None  # the checkpoint's online rotations (validate_environment reads them)

    def validate_environment(self, *, device_map=None) -> None:
        sparsity = self.config._other.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise CheckpointError(
                "this checkpoint stores sparse weights in a compressed sparse format llmpress cannot read yet",
                got=sparsity.get("format"),
                expected="dense sparsity (zeros stored as zeros)",
            )
        self.config.schemes()  # clear errors for schemes llmpress cannot load, before any work
        transforms = read_transform_config(self.config._other.get("transform_config"))
        self.transforms = None if transforms is None else StoredTransforms(transforms, self.config.kv_cache_scheme is not None)

    def _process_model_before_weight_loading(self, model: nn.Module) -> None:
        compressed = self.config.quantization_status == "compressed"
        schemes = self.config.schemes()
        if self.transforms is not None:  # on the skeleton, where class names match as compressed-tensors matches them
            self.transforms.plan_for(model)
        by_module: dict[str, set[str]] = {}
        for key in self.checkpoint_keys:
            owner, _, local = key.rpartition(".")
            by_module.setdefault(owner, set()).add(local)
        self.targets: dict[str, _Target] = {}
        routers = moe_routers(model)
        for name, (module, scheme) in assign_by_targets(model, [(s.targets, s) for s in schemes], self.config.ignore).items():
            if not is_linear(module):
                continue
            fmt = scheme.format if compressed and scheme.format else "dense"
            self.targets[name] = _Target(module, scheme, fmt, by_module.get(name, set()), name in routers)
            if not self.config.dequantize and scheme.weights is not None and not self.targets[name].own_forward:
                model.set_submodule(name, QuantizedLinear.like(module, scheme))
        self.quantized_modules = sorted(self.targets)
        if self.config.kv_cache_scheme:
            self._expect_kv_cache_scales(model)

    def _expect_kv_cache_scales(self, model: nn.Module) -> None:
        """Attention modules get ``k_scale`` / ``v_scale`` for the checkpoint to fill, and put
        their keys and values on the fp8 grid, as transformers + compressed-tensors do."""
        try:
            args = kv_cache_args(self.config.kv_cache_scheme)
        except (LlmpressError, ValueError) as exc:
            logger.warning("the checkpoint's kv_cache_scheme cannot be applied (%s): the KV cache stays in full precision", exc)
            return
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        dtype = model_dtype(model)
        modules = attention_modules(model)
        for module in modules.values():
            KVCacheQuantizer.attach(module, args).expect_scales(module, heads, dtype)
        if not modules:
            logger.warning("the checkpoint's kv_cache_scheme found no attention module that caches keys and values here")

    def param_needs_quantization(self, model: nn.Module, param_name: str) -> bool:
        return param_name.rpartition(".")[0] in self.targets or (self.transforms is not None and self.transforms.claims(param_name))

    def create_quantized_param(self, model: nn.Module, param_name: str, tensor: torch.Tensor, device: torch.device) -> None:
        if self.transforms is not None and self.transforms.claims(param_name):
            self.transforms.keep(param_name, tensor.to(device))
            return
        owner, _, local = param_name.rpartition(".")
        target = self.targets[owner]
        target.pending[local] = tensor.to(device)
        if set(target.pending) >= target.expected:
            self._finish(model, owner, target)

    def _finish(self, model: nn.Module, name: str, target: _Target) -> None:
        state, target.pending = target.pending, {}
        if "bias" in state:
            state["bias"] = state["bias"].to(target.dtype)
        try:
            if self.config.dequantize or target.scheme.weights is None or target.own_forward:
                # activation-only schemes keep their stored weights as they are ("dense")
                fmt = target.fmt if target.scheme.weights is not None else "dense"
                kept = model.get_submodule(name) if target.own_forward else None
                dense = dense_linear(target.in_features, target.out_features, state, target.scheme, fmt, target.dtype, target.input_major,
                                     into=kept)
                if kept is None:
                    model.set_submodule(name, dense)
            else:
                model.get_submodule(name).load_compressed(state, target.fmt)
        except KeyError as exc:
            raise CheckpointError(
                f"module {name!r} lacks a tensor its format needs",
                got=f"tensors {sorted(state)}",
                expected=f"{exc.args[0]!r} for format {target.fmt!r}",
            ) from None
        target.done = True

    def update_missing_keys(self, model: nn.Module, missing: list[str]) -> list[str]:
        waiting = [n for n, t in self.targets.items() if not t.done]
        for name in waiting:
            self._finish(model, name, self.targets[name])  # raises, naming what is missing
        return [k for k in missing if k.rpartition(".")[0] not in self.targets]

    def _process_model_after_weight_loading(self, model: nn.Module) -> None:
        # llmpress's own record (config.json's llmpress_sparsity), else an older file's sparsity_config
        record = getattr(getattr(model, "config", None), SPARSITY_KEY, None)
        mark_sparse_modules(model, record or self.config._other.get("sparsity_config"))
        if self.transforms is not None:
            count = self.transforms.attach_all(model)
            logger.info("%d online rotation(s) attached (transform groups %s)", count, sorted(self.transforms.config.config_groups))

    @property
    def is_trainable(self) -> bool:
        return bool(self.config.dequantize)
