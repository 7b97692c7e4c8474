"""Quantization on a module: the scheme, its scales, and the input fake-quant hook.

A quantized ``nn.Linear`` carries its scheme in its state (``state.py``) and buffers
``weight_scale`` (``weight_zero_point`` when asymmetric, ``weight_global_scale`` for NVFP4) and,
for static activations, ``input_scale`` (NVFP4: ``input_global_scale``). Its weight holds values
on the quantization grid once frozen (``Status.FROZEN``), so a plain forward already computes
what the compressed model computes; input activations are fake-quantized by a forward pre-hook.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from llmpress import native
from llmpress.compat import own_buffers, tensor_version
from llmpress.lifecycle.compute_dtype import stored_dtype
from llmpress.lifecycle.state import Status, forget_state_if_empty, scheme_of, state_of
from llmpress.parallel.fsdp import is_dtensor, like
from llmpress.quant.observers import weight_global_scale, weight_qparams
from llmpress.quant.qdq import fake_quantize, fake_quantize_activation
from llmpress.quant.scheme import QuantizationArgs, QuantizationScheme

__all__ = [
    "attach_scheme",
    "same_grid",
    "freeze_weight",
    "replace_weight",
    "set_weight_qparams",
    "store_weight_qparams",
    "set_module_buffer",
    "scale_dtype_for",
    "fused_families",
    "share_global_scales",
    "set_input_scale",
    "enable_input_quantization",
    "fake_quantize_module_input",
    "detach_quantization",
]


def attach_scheme(module: nn.Module, scheme: QuantizationScheme) -> None:
    """``module`` is to be quantized by ``scheme`` (``Status.ATTACHED``); a module already frozen
    on a grid of the same scheme stays frozen."""
    state = state_of(module)
    frozen = state.status == Status.FROZEN and state.scheme is not None and same_grid(state.scheme, scheme)
    state.scheme = scheme
    state.status = Status.FROZEN if frozen else Status.ATTACHED


def same_grid(a: QuantizationScheme, b: QuantizationScheme) -> bool:
    """Whether two schemes put weights and inputs on the same grid (their targets aside). How the
    scales were chosen (``observer``) and a column order that leaves the groups in place (GPTQ's
    ``actorder: static`` / ``weight``) do not change the grid: a training stage's W4A16 after GPTQ's
    keeps GPTQ's scales (while they counted, it re-observed the scales and undid GPTQ's rounding)."""
    return (_grid(a.weights), _grid(a.input_activations)) == (_grid(b.weights), _grid(b.input_activations))


def _grid(args: QuantizationArgs | None) -> QuantizationArgs | None:
    """``args`` without what does not change the stored grid."""
    if args is None:
        return None
    order = getattr(args.actorder, "value", args.actorder)
    return args.model_copy(update={"observer": None, "observer_kwargs": {}, "actorder": order if order == "group" else None})


def set_module_buffer(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set, replace or (with None) remove a persistent buffer such as ``weight_scale``."""
    buffers = own_buffers(module)
    if value is None:
        buffers.pop(name, None)
        return
    if name in buffers:
        buffers[name] = value
    else:
        module.register_buffer(name, value)


#: Linears that vLLM fuses into one layer, by their names under one parent: NVFP4 gives them one
#: global scale so that the fused layer is exact (as llm-compressor does)
FUSED_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))


def fused_families(model: nn.Module) -> dict[nn.Module, tuple[nn.Module, ...]]:
    """Each NVFP4 module's fused family (itself with its q/k/v or gate/up siblings under one
    parent, where all of them are NVFP4), for ``share_global_scales``."""
    families: dict[nn.Module, tuple[nn.Module, ...]] = {}
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in FUSED_NAMES:
            members = tuple(children.get(name) for name in names)
            if all(m is not None and _has_global_scale(m) for m in members):
                families.update(dict.fromkeys(members, members))
    return families


def share_global_scales(modules: list[nn.Module], families: dict[nn.Module, tuple[nn.Module, ...]]) -> None:
    """Give each NVFP4 module of ``modules`` without one its ``weight_global_scale``: its fused
    family's (``fused_families``: one scale from the family's largest magnitude), else its own.
    Call it before the weights are rounded (it reads their magnitudes)."""
    for module in modules:
        if not _has_global_scale(module) or getattr(module, "weight_global_scale", None) is not None:
            continue
        members = families.get(module, (module,))
        # a member already rounded keeps its grid: the others take its scale
        fixed = [m.weight_global_scale for m in members if getattr(m, "weight_global_scale", None) is not None]
        shared = fixed[0] if fixed else weight_global_scale([m.weight for m in members])
        for m in members:  # a copy each: a checkpoint keeps tensors shared between modules once
            if getattr(m, "weight_global_scale", None) is None:
                set_module_buffer(m, "weight_global_scale", shared.clone())


def _has_global_scale(module: nn.Module) -> bool:
    scheme = scheme_of(module)
    return scheme is not None and scheme.weights is not None and scheme.weights.has_global_scale


def scale_dtype_for(args, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight's scales are held in: the weight's, but float32 for MX power-of-two
    scales (2^-127, an all-zero group's, is zero in fp16)."""
    return torch.float32 if args is not None and args.is_mx else weight_dtype


def freeze_weight(module: nn.Module, scale_dtype: torch.dtype | None = None) -> float:
    """Round the weight onto its quantization grid, store scale / zero point; return the
    relative L2 error of the rounding (a per-module quality figure for reports). NVFP4 uses
    the module's ``weight_global_scale`` (set first by ``share_global_scales``), else its own."""
    weight = module.weight.data
    scale, zero_point, global_scale = store_weight_qparams(module, scale_dtype)
    quantized = fake_quantize(weight.float(), scale, zero_point, scheme_of(module).weights, global_scale)
    error = float((quantized - weight.float()).norm() / weight.float().norm().clamp(min=1e-12))
    replace_weight(module, quantized)
    return error


def store_weight_qparams(module: nn.Module, scale_dtype: torch.dtype | None = None) -> tuple:
    """Store the weight's scale and zero point (``freeze_weight`` without the rounding: a
    compressor rounds the weight as it packs it, to the same integers); returns them with the
    global scale. The module counts as frozen."""
    args = scheme_of(module).weights
    weight = module.weight.data
    share_global_scales([module], {})  # NVFP4 without a family's scale: its own
    global_scale = getattr(module, "weight_global_scale", None)
    scale, zero_point = weight_qparams(weight, args, global_scale)
    scale = scale.to(scale_dtype or scale_dtype_for(args, stored_dtype(module)))
    set_module_buffer(module, "weight_scale", scale)
    set_module_buffer(module, "weight_zero_point", zero_point)
    state_of(module).status = Status.FROZEN
    return scale, zero_point, global_scale


def replace_weight(module: nn.Module, value: torch.Tensor) -> None:
    """Make ``value`` (a fresh result the caller hands over) the data of ``module.weight``,
    rather than writing it into the old storage: a weight still memory-mapped from its checkpoint
    is a copy-on-write mapping, and writing into it faults and copies every page (many times the
    time of a fresh tensor). A view of a larger result (one module's rows of a stacked solve) is
    copied out, so it does not keep the rest alive or share storage in a save. A sharded weight (FSDP's DTensor) is written in place."""
    old = module.weight.data
    value = value.detach().to(device=old.device, dtype=old.dtype)
    if is_dtensor(old):  # FSDP: ``value`` is the whole weight; this rank keeps its shard
        old.copy_(like(value, old))
        return
    if value.shape != old.shape:
        old.copy_(value)
        return
    if value.data_ptr() == old.data_ptr():
        return  # computed in place already
    if value.untyped_storage().nbytes() != value.numel() * value.element_size() or not value.is_contiguous():
        # a part of a larger tensor; GPTQ's results are rows of a transposed one
        transposed_rows = value.dim() == 2 and value.stride(0) == 1
        value = native.transposed(value.t()) if transposed_rows else value.clone(memory_format=torch.contiguous_format)
    module.weight.data = value


def set_weight_qparams(
    module: nn.Module, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None = None,
) -> None:
    """Store a weight already on its grid (from GPTQ, say) with the qparams that define the grid."""
    dtype = scale_dtype_for(scheme_of(module).weights, stored_dtype(module))
    replace_weight(module, weight)
    set_module_buffer(module, "weight_scale", scale.to(dtype))
    set_module_buffer(module, "weight_zero_point", zero_point)
    if global_scale is not None:
        set_module_buffer(module, "weight_global_scale", global_scale)
    state_of(module).status = Status.FROZEN


def set_input_scale(module: nn.Module, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> None:
    """A static input scale (and zero point, for asymmetric inputs), as compressed-tensors stores them."""
    set_module_buffer(module, "input_scale", scale.reshape(1).to(stored_dtype(module)))
    set_module_buffer(module, "input_zero_point", None if zero_point is None else zero_point.reshape(1))


def enable_input_quantization(module: nn.Module) -> None:
    """Fake-quantize the module's input on every forward, as the compressed model does."""
    state = state_of(module)
    args = state.scheme.input_activations
    if args is None or state.input_hook is not None:
        return

    def hook(mod: nn.Module, inputs: tuple) -> tuple:
        return (fake_quantize_module_input(mod, inputs[0], args), *inputs[1:])

    state.input_hook = module.register_forward_pre_hook(hook)


def fake_quantize_module_input(module: nn.Module, x: torch.Tensor, args) -> torch.Tensor:
    """``x`` fake-quantized as ``module``'s input: with its calibrated ``input_scale`` /
    ``input_zero_point`` / ``input_global_scale`` where it has them (the training hook and the
    runtime module both quantize inputs this way). Modules that read one tensor with the same
    dynamic args and no calibrated qparams (q/k/v, gate/up) get one result (``_shared_input``)."""
    qparams = (getattr(module, "input_scale", None), getattr(module, "input_zero_point", None),
               getattr(module, "input_global_scale", None))
    # not under autograd, nor traced (a graph has its own), nor for inference tensors (no
    # version counter tells whether one was written in between)
    shareable = not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling() and not x.is_inference()
    if qparams == (None, None, None) and shareable:
        return _shared_input.get(x, args)
    return fake_quantize_activation(x, args, *qparams)


class _SharedInput(threading.local):
    """The last input fake-quantized without calibrated qparams, and its result, kept while
    that input lives (a weak reference drops the result with it) and is not written to: the
    next module reading the same tensor with equal args gets the same result, not another
    pass over the tensor. Writes are seen through PyTorch's version counters, so a write that
    bypasses them (through ``.data`` or a numpy alias between two modules' reads) is not."""

    def __init__(self) -> None:
        self.entry: tuple | None = None  # (weakref to the input, its version, args, result, its version)

    def get(self, x: torch.Tensor, args) -> torch.Tensor:
        entry = self.entry
        if (entry is not None and entry[0]() is x and entry[1] == tensor_version(x) and entry[2] == args
                and entry[4] == tensor_version(entry[3])):  # neither written since (a module changing its input in place)
            return entry[3]
        result = fake_quantize_activation(x, args)
        self.entry = (weakref.ref(x, self._drop), tensor_version(x), args, result, tensor_version(result))
        return result

    def _drop(self, reference: weakref.ref) -> None:
        if self.entry is not None and self.entry[0] is reference:
            self.entry = None


_shared_input = _SharedInput()


def detach_quantization(module: nn.Module) -> None:
    """Remove every trace of quantization from a module (its weight is left as it is; a pruning
    mark or a KV-cache quantizer stays)."""
    state = state_of(module)
    if state.input_hook is not None:
        state.input_hook.remove()
        state.input_hook = None
    for name in ("weight_scale", "weight_zero_point", "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale"):
        set_module_buffer(module, name, None)
    state.scheme = state.status = None
    forget_state_if_empty(module)
