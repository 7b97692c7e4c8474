"""Describe a checkpoint folder without loading its weights: format, schemes, sizes, recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmpress.checkpoint.sparsity import SPARSITY_KEY
from llmpress.errors import CheckpointError, UnsupportedModelError
from llmpress.formats import format_for
from llmpress.loading.remote_code import require_trust_for_remote_code
from llmpress.models import build, model_class
from llmpress.models.linear import input_major, is_linear
from llmpress.modifiers.autoround.record import record_of as autoround_record_of
from llmpress.modifiers.mixed_precision.choose import record_of
from llmpress.quant.groups import whole_groups
from llmpress.quant.scheme import QuantizationArgs, QuantizationScheme, QuantizationStrategy
from llmpress.runtime import QuantizedLinear
from llmpress.runtime.decode import path_name
from llmpress.targets import assign_by_targets
from llmpress.tensorfiles.verify import structural_problems, verify_checkpoint
from llmpress.transforms.config import describe_transforms

__all__ = ["describe_args", "describe_checkpoint"]


def describe_args(args: QuantizationArgs | None, what: str) -> str:
    if args is None:
        return ""
    kind = f"fp{args.num_bits}" if args.is_float else f"int{args.num_bits}"
    strategy = f"group({args.group_size})" if args.strategy == "group" else str(args.strategy)
    if args.has_global_scale:
        strategy = f"group({args.group_size}) + global scale"
    elif args.strategy == "block":
        strategy = "block({}x{})".format(*args.block_structure)
    if args.is_mx:
        strategy += " pow2 scales"
    mode = "dynamic" if args.dynamic else ("sym" if args.symmetric else "asym")
    return f"{kind} {mode} {strategy} {what}"


def describe_checkpoint(path: str | Path, trust_remote_code: bool = False, verify: bool = False) -> dict[str, Any]:
    """What a checkpoint folder holds, from its files, and what is wrong with them
    (``problems``: headers, index and config against the weights; with ``verify``, every tensor
    read too). A folder that brings its own Python code is refused unless ``trust_remote_code``."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError("not a checkpoint folder", got=str(folder), expected="a folder with config.json", fix="check the path")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    qcfg = config.get("quantization_config") or {}
    files = sorted(folder.glob("*.safetensors"))
    require_trust_for_remote_code(folder, trust_remote_code)
    problems = verify_checkpoint(folder) if verify else structural_problems(folder)[0]
    # a config the weights contradict (a million layers over two) is not built
    skeleton = None if problems else _skeleton(folder, trust_remote_code)
    schemes = {name: QuantizationScheme(**group) for name, group in (qcfg.get("config_groups") or {}).items()}
    # the same assignment the loaders make: each module to its most specific group
    assigned = (
        assign_by_targets(skeleton, [(s.targets, name) for name, s in schemes.items()], qcfg.get("ignore") or [])
        if skeleton is not None
        else None
    )
    groups = []
    for name, group in (qcfg.get("config_groups") or {}).items():
        scheme = schemes[name]
        parts = [describe_args(scheme.weights, "weights"), describe_args(scheme.input_activations, "inputs")]
        count, paths, deploys = None, None, None
        fmt = group.get("format") or qcfg.get("format")
        if assigned is not None:
            members = {n: m for n, (m, g) in assigned.items() if is_linear(m) and g == name}
            count, paths = len(members), _cpu_paths(list(members.values()), scheme, fmt)
            deploys = _deploys(members, scheme)
        groups.append({"name": name, "summary": ", ".join(p for p in parts if p), "targets": scheme.targets, "modules": count,
                       "format": fmt, "cpu_paths": paths, "vllm": deploys})
    recipe_path = folder / "recipe.yaml"
    return {
        "path": str(folder),
        "architecture": ",".join(config.get("architectures") or ["?"]),
        "model_type": config.get("model_type", "?"),
        "parameters": sum(p.numel() for p in skeleton.parameters()) if skeleton is not None else 0,
        "format": _format_of(qcfg),
        "quantization_status": qcfg.get("quantization_status", "-"),
        "groups": groups,
        "ignore": list(qcfg.get("ignore") or []),
        "files": len(files),
        "size_mb": sum(f.stat().st_size for f in files) / 1e6,
        "recipe": recipe_path.read_text(encoding="utf-8") if recipe_path.is_file() else None,
        "sparsity": _describe_sparsity(qcfg.get("sparsity_config") or config.get(SPARSITY_KEY)),
        "mixed_precision": record_of(config),
        "autoround": autoround_record_of(config),
        "rotations": describe_transforms(qcfg.get("transform_config")),
        "problems": [str(problem) for problem in problems],
    }


def _format_of(qcfg: dict[str, Any]) -> str:
    if qcfg.get("quant_method") == "fp8":  # formats/hf_fp8.py
        block = qcfg.get("weight_block_size")
        grid = "block({}x{})".format(*block) if block else "per tensor"
        return f"Hugging Face fp8, {grid}: read dense, as a source for any recipe"
    return qcfg.get("format", "dense (not quantized)")


def _cpu_paths(modules: list[nn.Module], scheme: QuantizationScheme, fmt: str | None) -> dict[str, int]:
    """Which path of ``llmpress.load`` each module would run on here (the kernel choice alone:
    no weights read)."""
    paths: dict[str, int] = {}
    for module in modules:
        kernel = path_name(QuantizedLinear.like(module, scheme).choose_kernel(fmt or format_for(scheme)))
        paths[kernel] = paths.get(kernel, 0) + 1
    return paths


def _deploys(members: dict[str, nn.Module], scheme: QuantizationScheme) -> str:
    """Whether vLLM (and transformers with compressed-tensors) take this group's shapes: its
    groups whole over every member's input features (``quant/groups.py``)."""
    columns = {n: m.weight.shape[0 if input_major(m) else -1] for n, m in members.items()}
    split = {n: c for n, c in columns.items() if not whole_groups(scheme, c)}
    weights = scheme.weights
    if not split:
        limit = _vllm_device_limit(scheme)
        return "loads (every group whole)" + (f"; {limit}" if limit else "")
    name, width = next(iter(split.items()))
    group = weights.group_size if weights is not None and weights.is_grouped and width % weights.group_size else scheme.input_activations.group_size
    return (f"refused: {len(split)} module(s) with input features not a multiple of the group size {group} "
            f"(e.g. {name}: {width}); llmpress reads them")


def _vllm_device_limit(scheme: QuantizationScheme) -> str | None:
    """Where vLLM (0.32) serves ``scheme``'s int weights on some devices only, or not as written:
    its CPU build takes int weights of 4 bits (and int8 x int8), drops int4 inputs' rounding and
    has no fp4 or MX kernel (measured: ``bench/README.md``, "Served by vLLM"); int4 weights with
    fp8 inputs run on Hopper GPUs only."""
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is not None and (weights.is_fp4 or weights.is_mx):
        return "vLLM serves these on GPUs: its CPU build has no kernel for NVFP4, MXFP4 or MXFP8 layers"
    if weights is not None and weights.strategy == QuantizationStrategy.BLOCK:
        return "vLLM's CPU build runs fp8 blocks only on a CPU with AMX"
    if weights is None or weights.is_float:
        return None
    if inputs is not None and inputs.is_float:
        return "vLLM serves int weights with fp8 inputs on Hopper GPUs only, 4-bit ones (its W4A8Fp8 reader)"
    int8_product = weights.num_bits == 8 and inputs is not None and inputs.num_bits == 8 and not weights.is_grouped
    if weights.num_bits != 4 and not int8_product:
        what = "weight-only layers" if inputs is None else f"weights with int{inputs.num_bits} inputs"
        return f"vLLM's CPU build refuses int{weights.num_bits} {what} (its CPU kernel takes 4-bit weights only)"
    if inputs is not None and inputs.num_bits == 4:
        return "vLLM's CPU build runs them as int4 weight-only layers: its kernel skips the int4 rounding of the inputs"
    return None


def _describe_sparsity(config: dict[str, Any] | None) -> str | None:
    if not config:
        return None
    share = config.get("global_sparsity")
    share = f"{share:.1%} zeros" if isinstance(share, (int, float)) else "zeros"
    targets = config.get("targets") or []
    return f"{config.get('sparsity_structure', 'unstructured')}, {share} in {len(targets)} target(s), stored {config.get('format', 'dense')}"


def _skeleton(folder: Path, trust_remote_code: bool) -> nn.Module | None:
    """The model built on the meta device (no memory): for parameter counts and module names."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            return build(model_class(config), config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, UnsupportedModelError):
        return None  # an architecture transformers does not know: describe the files only
