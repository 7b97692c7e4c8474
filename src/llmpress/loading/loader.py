"""``llmpress.load``: one loader for every quantization method (``docs/loading.md``).

Loading is two steps. ``read_checkpoint`` reads the config, asks the method's ``Quantizer`` to
adjust dtype and placement, builds the model with its parameters on ``meta`` (nothing
allocated), lets the quantizer swap in its modules, then streams the checkpoint one tensor at a
time: a tensor the quantizer claims goes to ``create_quantized_param``, any other is copied into
place. It never looks at the method.
``prepare_decode`` (``runtime/decode.py``) then sets the model up for inference: fused
projections and a compiled decode step. ``llmpress.load`` does both; ``oneshot``, ``train``,
``eval`` and ``inspect`` only read (``read_checkpoint``, ``read_model_and_processor``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint.sparsity import SPARSITY_KEY
from llmpress.compat import own_buffers, own_parameters
from llmpress.errors import CheckpointError, RecipeError, UnsupportedModelError
from llmpress.lifecycle.records import record_loading_quantizer, record_recipe
from llmpress.lifecycle.sparsity import mark_sparse_modules
from llmpress.loading.config import QuantizationConfig
from llmpress.loading.methods import config_from_dict, make_quantizer
from llmpress.loading.quantizer import Quantizer
from llmpress.loading.remote_code import require_trust_for_remote_code
from llmpress.loading.tokenizer import FolderTokenizer, read_tokenizer
from llmpress.memory import release_free_memory
from llmpress.models import KeyMap, build, fused_experts, linearize_experts, model_class
from llmpress.recipe import Recipe
from llmpress.runtime.decode import prepare_decode
from llmpress.tensorfiles.dtypes import as_dtype, named_dtype
from llmpress.tensorfiles.folder import model_folder
from llmpress.tensorfiles.read import (
    ShardEntry,
    stream_tensors,
)
from llmpress.tensorfiles.verify import sound_shards

__all__ = ["FolderTokenizer", "as_dtype", "load", "load_checkpoint", "model_folder", "read_checkpoint", "read_model_and_processor",
           "read_tokenizer"]

logger = logging.getLogger(__name__)


def load(
    path: str | Path,
    *,
    quantization_config: QuantizationConfig | dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | torch.device | dict[str, Any] | None = None,
    max_memory: dict[Any, int | str] | None = None,
    dequantize: bool = False,
    compile_decode: bool | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM from a local checkpoint folder.

    - A compressed-tensors checkpoint (llmpress's or llm-compressor's) loads into runtime modules
      that keep the weights compressed and run with CPU kernels; ``dequantize=True`` loads dense
      weights on the quantization grid instead (exactly what compressed-tensors computes).
    - A full-precision checkpoint with ``quantization_config=LlmpressConfig(bits=4)`` is quantized
      tensor by tensor as it streams in.
    - ``dtype`` is the dtype of the unquantized parts (default: the quantizer's choice, else the
      checkpoint's). ``device_map``: a device, ``{"module.prefix": device}``, or ``"auto"``.
    - Decoding is set up for speed (``prepare_decode``): int4 layers that read the same input
      (q/k/v, gate/up) run as one product, and ``generate()`` decodes with a static cache through
      a compiled step (``compile_decode``: True from the first call; None, wherever it works, once
      the model has generated ``runtime.decode.COMPILE_AFTER_TOKENS`` tokens, when the compile
      pays; False never). ``LLMPRESS_COMPILE=0`` turns the default off.
    - ``trust_remote_code``: a model folder that brings its own Python code (an ``auto_map``) is
      refused unless this is True (``loading/remote_code.py``); nothing ever asks on standard input.

    ``read_checkpoint`` takes the same arguments but ``compile_decode`` and reads only.
    """
    model = read_checkpoint(path, quantization_config=quantization_config, dtype=dtype, device_map=device_map,
                            max_memory=max_memory, dequantize=dequantize, trust_remote_code=trust_remote_code)
    prepare_decode(model, compile_decode)
    return model


def read_checkpoint(
    path: str | Path,
    *,
    quantization_config: QuantizationConfig | dict[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | torch.device | dict[str, Any] | None = None,
    max_memory: dict[Any, int | str] | None = None,
    dequantize: bool = False,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The model a checkpoint folder holds, in eval mode, as ``load`` reads it (its arguments),
    without setting it up for inference: no projections fused, ``generate()`` as transformers
    has it."""
    folder = model_folder(path)
    config = _read_config(folder, trust_remote_code)
    qconfig, pre_quantized = _quantization_config(config, quantization_config)
    quantizer: Quantizer | None = None
    if qconfig is not None:
        if dequantize and hasattr(qconfig, "dequantize"):
            qconfig.dequantize = True
        quantizer = make_quantizer(qconfig, pre_quantized=pre_quantized)
        if not pre_quantized and quantizer.requires_calibration:
            raise CheckpointError(
                f"{qconfig.quant_method} cannot quantize while loading: it needs calibration",
                fix="compress the model with `llmpress oneshot` first, then load the result",
            )
        quantizer.validate_environment(device_map=device_map)
        dtype = quantizer.update_dtype(as_dtype(dtype))
        device_map = quantizer.update_device_map(device_map)
        max_memory = quantizer.adjust_max_memory(max_memory)
    dtype = as_dtype(dtype) or _checkpoint_dtype(config)

    shards = sound_shards(folder)  # headers, index and config against the weights, before the model is built
    model = _skeleton(config, dtype, trust_remote_code)
    shards = _model_names(model, shards)
    keys = {entry.name for entries in shards.values() for entry in entries}
    if quantizer is not None:
        quantizer.process_model_before_weight_loading(model, checkpoint_keys=keys)
    placement = _placement(model, device_map, max_memory)

    unexpected = []
    for file, entries in shards.items():
        for entry, read in stream_tensors(file, entries):
            device = placement(entry.name)
            if quantizer is not None and quantizer.param_needs_quantization(model, entry.name):
                quantizer.create_quantized_param(model, entry.name, read(), device)
                release_free_memory()
            elif not _assign(model, entry, read, device):
                unexpected.append(entry.name)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if quantizer is not None:
        missing = quantizer.update_missing_keys(model, missing)
        unexpected = quantizer.update_unexpected_keys(model, unexpected)
    if missing:
        raise CheckpointError(
            "the checkpoint lacks weights its config describes",
            got=f"{len(missing)} missing, e.g. {missing[:4]}",
            expected="every weight of the model",
            fix="check that config.json and the *.safetensors files belong together",
        )
    if unexpected:
        logger.warning("%d checkpoint tensor(s) fit no weight of the model and were skipped: %s", len(unexpected), unexpected[:4])
    if quantizer is not None:
        quantizer.process_model_after_weight_loading(model)
        record_loading_quantizer(model, quantizer)
    else:  # a pruned checkpoint's record, so that saving the model again keeps it
        mark_sparse_modules(model, getattr(config, SPARSITY_KEY, None))
    recipe_file = folder / "recipe.yaml"
    if recipe_file.is_file():
        try:  # what was applied, kept for the next save; the weights do not depend on it
            record_recipe(model, Recipe.from_file(recipe_file))
        except RecipeError as exc:
            logger.warning("%s is not a recipe llmpress can read, so a later save will not carry it: %s", recipe_file, exc)
    model.eval()
    return model


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | str | None = torch.float32,
                    trust_remote_code: bool = False) -> nn.Module:
    """The exact dense view of a checkpoint in ``dtype`` (None: the dtype its config names), read
    only (``read_checkpoint(path, dtype=dtype, dequantize=True)``). What ``eval`` (in float32, so
    figures match compressed-tensors' full-precision ones) and ``oneshot`` (in the model's own
    dtype) use."""
    return read_checkpoint(path, dtype=dtype, dequantize=True, trust_remote_code=trust_remote_code)


def read_model_and_processor(path: str | Path, dtype: torch.dtype | str | None = torch.float32,
                             trust_remote_code: bool = False) -> tuple[nn.Module, Any]:
    """A model (plain or compressed-tensors checkpoint, its exact dense view in ``dtype``; None:
    the dtype its config names) and its tokenizer (None when the folder has none; read when first
    used: ``tokenizer.py``), from a folder or a cached Hub model id."""
    folder = model_folder(path)
    model = load_checkpoint(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    return model, FolderTokenizer.of(folder, trust_remote_code)


def _read_config(folder: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    require_trust_for_remote_code(folder, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as exc:  # a user's file at the boundary of another library: whatever it raises is about the file
        raise UnsupportedModelError(
            "transformers cannot read this model's config",
            got=f"{folder}: {_first_line(exc)}",
            expected="a config.json of an architecture transformers knows, with values it accepts",
        ) from exc


def _first_line(exc: BaseException) -> str:
    """A foreign library's exception in one line: its type and the start of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _quantization_config(config, requested) -> tuple[QuantizationConfig | None, bool]:
    stored = getattr(config, "quantization_config", None)
    if stored is not None:
        del config.quantization_config  # the skeleton is built plain; the quantizer adapts it
        stored = config_from_dict(stored)
        if requested is not None:
            requested = config_from_dict(requested)
            if requested.quant_method != stored.quant_method:
                raise CheckpointError(
                    "this checkpoint is already quantized; it cannot be quantized again while loading",
                    got=f"stored {stored.quant_method}, requested {requested.quant_method}",
                    fix="load it without quantization_config, or start from the full-precision checkpoint",
                )
            return requested, True
        return stored, True
    if requested is None:
        return None, False
    return config_from_dict(requested), False


def _checkpoint_dtype(config) -> torch.dtype:
    return named_dtype(getattr(config, "dtype", None) or config.__dict__.get("torch_dtype"), torch.float32)


def _skeleton(config, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model with every parameter on ``meta`` (buffers such as rotary tables are real), of
    the class ``config.architectures`` names, as ``from_pretrained`` builds it. Its weights are
    not initialised (every one is read from the checkpoint, as in transformers' own
    ``from_pretrained``); ``load`` ties the tied ones once they are read."""
    from accelerate import init_empty_weights

    cls = model_class(config)
    try:
        with init_empty_weights(include_buffers=False), _no_weight_init():
            return build(cls, config, dtype=dtype, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, ArithmeticError, RuntimeError, AttributeError, KeyError, IndexError) as exc:
        # a config transformers read but cannot build (a negative size, zero heads): about the file
        raise UnsupportedModelError(
            f"transformers cannot build {cls.__name__} from this config",
            got=f"{getattr(config, 'model_type', '?')}: {_first_line(exc)}",
            expected="a config.json of an architecture transformers knows, with sizes it accepts",
        ) from exc


def _model_names(model: nn.Module, shards: dict[Path, list[ShardEntry]]) -> dict[Path, list[ShardEntry]]:
    """The shards' entries under the model's names (transformers' renamings and base-model
    prefix); fused MoE experts whose checkpoint is per expert become one Linear per expert
    first, so per-expert tensors load as they are."""
    names = KeyMap(model)
    renamed = {entry.name: names.to_model(entry.name) for entries in shards.values() for entry in entries}
    model_keys = set(renamed.values())
    per_expert = [name for name, _ in fused_experts(model) if f"{name}.down_proj" not in model_keys]
    if per_expert:
        linearize_experts(model, only=per_expert)
        names = KeyMap(model)
        renamed = {key: names.to_model(key) for key in renamed}
    return {file: [replace(e, name=renamed[e.name]) for e in entries] for file, entries in shards.items()}


def _no_weight_init():
    """transformers' switch for skipping weight initialisation, where this version has it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _placement(model: nn.Module, device_map, max_memory):
    """A function from a tensor name to the device it goes to."""
    if device_map == "auto":
        from accelerate import infer_auto_device_map

        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=getattr(model, "_no_split_modules", None)
        )
    if device_map is None or isinstance(device_map, (str, torch.device)):
        device = torch.device(device_map or "cpu")
        return lambda name: device
    prefixes = sorted(device_map.items(), key=lambda item: -len(item[0]))

    def device_of(name: str) -> torch.device:
        for prefix, device in prefixes:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return torch.device("cpu" if device == "disk" else device)
        raise CheckpointError("the device_map does not place this tensor", got=name, fix='add its module, or "" for the rest')

    return device_of


def _assign(model: nn.Module, entry: ShardEntry, read, device: torch.device) -> bool:
    """Read a checkpoint tensor into its parameter or buffer (in the model's dtype); False when
    the model has no such tensor."""
    name = entry.name
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    parameters, buffers = own_parameters(module), own_buffers(module)
    slots = parameters if attr in parameters else buffers if attr in buffers else None
    if slots is None or slots[attr] is None:
        return False
    current = slots[attr]
    if tuple(current.shape) != entry.shape:
        raise CheckpointError(
            f"tensor {name!r} has the wrong shape for the model",
            got=entry.shape,
            expected=tuple(current.shape),
            fix="check that config.json and the weights belong together",
        )
    tensor = read(current.dtype if current.is_floating_point() else None).to(device)
    if slots is parameters:
        slots[attr] = nn.Parameter(tensor, requires_grad=current.requires_grad and tensor.is_floating_point())
    else:
        slots[attr] = tensor
    return True
