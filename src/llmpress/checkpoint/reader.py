"""A minimal reader of compressed-tensors checkpoints (ours and llm-compressor's).

It builds the model from its config, decompresses every quantized module to dense weights on
the quantization grid (scales kept as buffers, input quantization switched on), so the model
computes what the compressed checkpoint means. The quantizer pipeline (``llmpress.load``) is the
full loader; this is what ``eval`` and ``oneshot`` use to read a checkpoint back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from llmpress.checkpoint.save import route_save_pretrained
from llmpress.errors import CheckpointError, UnsupportedModelError
from llmpress.formats import FORMATS
from llmpress.quant.attach import set_module_buffer, attach_scheme, enable_input_quantization
from llmpress.quant.scheme import QuantizationScheme
from llmpress.recipe import APPLIED_RECIPE_ATTR, Recipe
from llmpress.targets import assign_by_targets

__all__ = ["load_checkpoint", "read_tensors"]


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError("no .safetensors weights in the checkpoint", got=str(folder), expected="model*.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from a plain or compressed-tensors checkpoint folder, in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            "not a model checkpoint folder",
            got=str(folder),
            expected="a folder with config.json and *.safetensors",
            fix="check the --model path",
        )
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedModelError(
            "transformers cannot read this model's config",
            got=f"{folder}: {str(exc).splitlines()[0]}",
            expected="a config.json of an architecture transformers knows",
        ) from None
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                "transformers cannot load this checkpoint",
                got=f"{folder}: {str(exc).splitlines()[0]}",
                expected="config.json with its *.safetensors weights",
            ) from None
    else:
        qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
        if qcfg.get("quant_method") != "compressed-tensors":
            raise UnsupportedModelError(
                "this reader only knows compressed-tensors checkpoints",
                got=qcfg.get("quant_method"),
                expected="quant_method 'compressed-tensors'",
            )
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _load_compressed(model, read_tensors(folder), qcfg, dtype)
    recipe_file = folder / "recipe.yaml"
    if recipe_file.is_file():
        setattr(model, APPLIED_RECIPE_ATTR, Recipe.from_file(recipe_file))
    if qcfg is not None:
        route_save_pretrained(model)
    model.eval()
    return model


def _load_compressed(model: nn.Module, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any], dtype: torch.dtype) -> None:
    compressed = qcfg.get("quantization_status", "compressed") == "compressed"
    ignore = list(qcfg.get("ignore") or [])
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        owner, _, local_name = key.rpartition(".")
        by_module.setdefault(owner, {})[local_name] = tensor
    schemes = [
        QuantizationScheme(**{**group, "format": group.get("format") or qcfg.get("format")})
        for group in (qcfg.get("config_groups") or {}).values()
    ]
    chosen = assign_by_targets(model, [(s.targets, s) for s in schemes], ignore)
    seen = {name for name, (module, _) in chosen.items() if isinstance(module, nn.Linear)}
    for name in seen:
        module, scheme = chosen[name]
        local = by_module.pop(name, {})
        for local_name in local:
            tensors.pop(f"{name}.{local_name}")
        try:
            local = FORMATS.get(scheme.format if compressed else "dense").decompress(local, scheme, dtype)
        except KeyError as exc:
            raise CheckpointError(
                f"module {name!r} lacks a tensor its format needs",
                got=f"tensors {sorted(local)}",
                expected=f"{exc.args[0]!r} for format {scheme.format!r}",
            ) from None
        attach_scheme(module, scheme)
        module.weight.data = local.pop("weight").to(dtype)
        if "bias" in local:
            module.bias.data = local.pop("bias").to(dtype)
        for buffer_name, value in local.items():
            set_module_buffer(module, buffer_name, value)
        enable_input_quantization(module)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k.rpartition(".")[0] not in seen and not _is_tied(model, k)]
    if missing or unexpected:
        raise CheckpointError(
            "the checkpoint does not fit the model its config describes",
            got=f"missing {missing[:5]}, unexpected {unexpected[:5]}",
            expected="every weight of the model, and nothing else",
        )
    model.tie_weights()


def _is_tied(model: nn.Module, key: str) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and key.endswith("lm_head.weight")
