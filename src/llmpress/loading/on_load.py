"""Quantize-on-load: a full-precision checkpoint becomes int4 / int8 runtime modules while it
streams in. Each weight is quantized (RTN, min-max) as it arrives and its float copy dropped, so
peak memory stays near the compressed size. The model saves through the one save path, as a
compressed-tensors checkpoint.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmpress.compat import own_parameters
from llmpress.errors import CheckpointError
from llmpress.loading.config import LlmpressConfig, QuantizationMethod
from llmpress.loading.methods import register_quantization_method
from llmpress.loading.quantizer import Quantizer
from llmpress.models.linear import features, input_major, is_linear
from llmpress.quant.observers import weight_qparams
from llmpress.quant.qdq import quantize
from llmpress.quant.scheme import QuantizationScheme
from llmpress.runtime import QuantizedLinear, kernels
from llmpress.targets import assign_by_targets, name_conv1d_targets

__all__ = ["LlmpressQuantizer", "quantize_weight_into"]

logger = logging.getLogger(__name__)


_ROWS_PER_CHUNK = 512  # rows quantized at once: bounds the float temporaries to a slice of the weight


def _kernel_group_scheme(name: str, module: nn.Module, scheme: QuantizationScheme) -> QuantizationScheme:
    """``scheme``, or for a 4-bit module whose columns its group does not divide, the scheme in
    the largest smaller group that divides them and the int4 kernel takes (targeting this module
    by name), so it loads and saves as whole groups and runs on the kernel."""
    args = scheme.weights
    if args.num_bits != 4 or args.strategy != "group" or input_major(module):
        return scheme
    columns, rows = features(module)
    if columns % args.group_size == 0:
        return scheme
    fits = [g for g in kernels.INT4_GROUP_SIZES if g < args.group_size and kernels.int4_supported(rows, columns, g)]
    if not fits:
        return scheme
    weights = args.model_copy(update={"group_size": max(fits)})
    return scheme.model_copy(update={"targets": [name], "weights": weights})


def quantize_weight_into(module: QuantizedLinear, weight: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """RTN-quantize a float ``weight`` under ``module``'s scheme and load it into ``module``.
    The scale is rounded to ``scale_dtype`` (as stored) before the weight is rounded with it."""
    args = module.scheme.weights
    scale, zero_point = weight_qparams(weight, args)
    scale = scale.to(scale_dtype)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    per_row = scale.shape[0] == weight.shape[0]
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        q[rows] = quantize(
            weight[rows], scale[rows] if per_row else scale,
            None if zero_point is None else (zero_point[rows] if per_row else zero_point), args,
        )
    module.load_quantized(q, scale, zero_point)


@register_quantization_method(QuantizationMethod.LLMPRESS, config=LlmpressConfig)
class LlmpressQuantizer(Quantizer):
    config: LlmpressConfig

    def validate_environment(self, *, device_map=None) -> None:
        if self.pre_quantized:
            raise CheckpointError(
                "a checkpoint cannot carry quant_method 'llmpress'",
                fix="llmpress saves quantized models as compressed-tensors; load that checkpoint as it is",
            )

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        # llmpress's int4 kernel is exact to 1e-4 in float32, so the rest of the model runs in
        # float32 too (a bf16 model would only add its rounding: ~2e-2 on the logits of a
        # 30-layer model). PyTorch's int4 / int8 kernels compute in bf16: with them the rest of
        # the model runs in bf16 too, which saves a cast at every layer and halves the memory
        # of embeddings and norms.
        exact = self.config.bits == 4 and kernels.int4_layout() == "blocks64"
        self.dtype = dtype or (torch.float32 if exact else torch.bfloat16)
        return self.dtype

    def _process_model_before_weight_loading(self, model: nn.Module) -> None:
        scheme = self.config.scheme()
        # llmpress's own config: its Linear means every linear layer, Conv1D included
        chosen = assign_by_targets(model, [(scheme.targets, scheme)], self.config.ignore, linear_alias=True)
        chosen = name_conv1d_targets({n: (m, s) for n, (m, s) in chosen.items() if is_linear(m)})
        self.quantized_modules = []
        regrouped: dict[tuple[int, int], list[str]] = {}
        for name, (module, module_scheme) in chosen.items():
            fitted = _kernel_group_scheme(name, module, module_scheme)
            if fitted is not module_scheme:
                regrouped.setdefault((features(module)[0], fitted.weights.group_size), []).append(name)
            model.set_submodule(name, QuantizedLinear.like(module, fitted))
            self.quantized_modules.append(name)
        self._targets = set(self.quantized_modules)
        for (columns, group), names in regrouped.items():
            logger.warning(
                "quantize-on-load: %d module(s) have %d input columns, not a multiple of group %d (%s ...): quantized in "
                "groups of %d instead, which divide them and the int4 kernel takes", len(names), columns,
                scheme.weights.group_size, names[0], group,
            )

    def param_needs_quantization(self, model: nn.Module, param_name: str) -> bool:
        owner, _, local = param_name.rpartition(".")
        return local == "weight" and owner in self._targets

    def create_quantized_param(self, model: nn.Module, param_name: str, tensor: torch.Tensor, device: torch.device) -> None:
        owner = param_name.rpartition(".")[0]
        module = model.get_submodule(owner)
        expected = (module.in_features, module.out_features) if module.input_major else (module.out_features, module.in_features)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(
                f"tensor {param_name!r} has the wrong shape for the model",
                got=tuple(tensor.shape),
                expected=expected,
            )
        quantize_weight_into(module, tensor.to(device), self.dtype)

    def update_missing_keys(self, model: nn.Module, missing: list[str]) -> list[str]:
        self._quantize_tied_output(model)
        empty = [n for n in self.quantized_modules if model.get_submodule(n).kernel == "empty"]
        return missing + [f"{n}.weight" for n in empty]

    def _quantize_tied_output(self, model: nn.Module) -> None:
        """A quantized output projection tied to the embedding has no tensor of its own in the
        checkpoint: it is quantized from the embedding, which stays as it is for the lookup."""
        getter = getattr(model, "get_output_embeddings", None)
        output = getter() if getter is not None else None
        if not isinstance(output, QuantizedLinear) or output.kernel != "empty":
            return
        embedding = model.get_input_embeddings().weight
        if embedding.is_meta or tuple(embedding.shape) != (output.out_features, output.in_features):
            return
        own_parameters(output).pop("weight", None)  # what tie_weights() attached
        quantize_weight_into(output, embedding.detach(), self.dtype)
        model.config.tie_word_embeddings = False  # two tensors now: saved and loaded as such
        logger.info("quantize-on-load: the output projection is a quantized copy of the tied embedding")

    @property
    def is_trainable(self) -> bool:
        return False
