"""Turn a model's modules into compressed tensors and the matching ``quantization_config``.

The state dict is compressed module by module through the format codecs; the config groups the
quantized modules by scheme, in the compressed-tensors JSON that vLLM and transformers read.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmpress.compat import own_buffers, own_parameters
from llmpress.errors import CheckpointError
from llmpress.formats import FORMATS, format_for
from llmpress.lifecycle.kv_cache import kv_cache_scheme_of
from llmpress.lifecycle.qat import qat_snapshot
from llmpress.lifecycle.records import HeldWeights, held_weights, transform_config_of
from llmpress.lifecycle.state import Status, quantized_modules, status_of
from llmpress.memory import release_free_memory
from llmpress.models.linear import input_major, is_linear
from llmpress.quant.groups import EXPERT_NAME, name_targets
from llmpress.quant.scheme import QuantizationScheme
from llmpress.targets import matches, moe_routers
from llmpress.transforms.online import drop_repeated_matrices, written_transform_config

__all__ = ["compressed_state_dict", "name_experts", "quantization_config_for", "quantization_config_of", "unique_state_dict"]

logger = logging.getLogger(__name__)


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with tied tensors kept once (first name wins), detached."""
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and not tensor.is_meta and key in seen:  # a held weight (meta) is its own
            continue
        seen.add(key)
        state[name] = tensor.detach()
    return state


def compressed_state_dict(model: nn.Module, save_compressed: bool = True,
                          emit: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
    """The tensors to write: quantized modules compressed by their scheme's format. With
    ``emit``, each module's tensors go to ``emit(name, tensor)`` as soon as they are made, then
    the model's other tensors, and the dict returned is empty: the compressed model never sits in
    memory whole (a save streams it to its files)."""
    state = unique_state_dict(model)
    drop_repeated_matrices(model, state)  # an online rotation's matrix once, as compressed-tensors writes it

    def put(prefix: str, local: dict[str, torch.Tensor]) -> None:
        for k, v in local.items():
            if emit is None:
                state[prefix + k] = v
            else:
                emit(prefix + k, v)

    held = held_weights(model)  # finished layers still held as integers: rebuilt one module at a time
    uneven, transposed = [], []
    for name, module, scheme in quantized_modules(model):
        if input_major(module) and scheme.weights is not None and save_compressed:
            transposed.append(name)
        prefix = f"{name}."
        if hasattr(module, "compressed_state"):  # a runtime module: already compressed
            local = module.compressed_state()
            if not save_compressed:
                local = FORMATS.get(module.format).decompress(local, scheme, module.default_dtype)
            for k in [k for k in state if k.startswith(prefix) and "." not in k[len(prefix):]]:
                del state[k]
            put(prefix, local)
            continue
        unfrozen = scheme.weights is not None and f"{prefix}weight_scale" not in state
        # mid-training (QAT on, or a session that will quantize the module later): the weights
        # as finalize would round them now
        status = status_of(module)
        in_training = status == Status.TRAINING or (unfrozen and status == Status.PENDING)
        if unfrozen and not in_training:
            raise CheckpointError(
                f"module {name!r} has a quantization scheme but its weight was never quantized",
                got="no weight_scale",
                expected="a finalized session (weights frozen on their grid)",
                fix="call session.finalize() (or use llmpress.oneshot) before saving",
            )
        if f"{prefix}weight" not in state:
            raise CheckpointError(
                f"module {name!r} shares its weight with another module and cannot be compressed alone",
                fix="quantize it through a modifier (which unties it) or add it to ignore",
            )
        columns = module.weight.shape[-1]
        if any(a is not None and a.is_grouped and columns % a.group_size for a in (scheme.weights, scheme.input_activations)):
            uneven.append(name)
        grid = None  # a held weight's integers, packed as they are
        if held is not None and state[f"{prefix}weight"].is_meta:
            grid = _stored_values(held, module, scheme) if save_compressed else None
            state[f"{prefix}weight"] = held.weight_of(module) if grid is None else grid
        if not (save_compressed or in_training):
            continue  # dense and frozen: the state dict already holds it
        own = [*own_parameters(module), *own_buffers(module)]
        local = {k: state.pop(prefix + k) for k in own if prefix + k in state}
        if in_training:  # mid-QAT: the weights as finalize would round them now
            local = qat_snapshot(module)
        local = {k: v.cpu() for k, v in local.items()}  # a model on a GPU is packed in host memory
        if grid is not None:
            local = FORMATS.get(format_for(scheme)).pack(local, scheme)
        elif save_compressed:
            local = FORMATS.get(format_for(scheme)).compress(local, scheme)
            release_free_memory()  # packing temporaries: give them back before the next module
        put(prefix, local)
    if uneven:  # (said before any work too: quant/groups.py)
        logger.info(
            "%d module(s) have a column count that is not a multiple of their (weight or input) group size (%s): "
            "llmpress reads them, but compressed-tensors (transformers, vLLM) may refuse to load them",
            len(uneven), ", ".join(uneven[:4]) + (" ..." if len(uneven) > 4 else ""),
        )
    if transposed:
        logger.warning(
            "%d Conv1D module(s) are stored in their own [in, out] layout (%s): llmpress reads them, and transformers "
            "does with CompressedTensorsConfig(dequantize=True) (5.24 and later); its default compressed route "
            "initializes only nn.Linear modules and cannot", len(transposed), transposed[0] + (" ..." if len(transposed) > 1 else ""),
        )
    if emit is not None:
        for key in list(state):  # in the model's order
            emit(key, state.pop(key))
    return state


def _stored_values(held: HeldWeights, module: nn.Module, scheme: QuantizationScheme) -> torch.Tensor | None:
    """The quantized values a held weight is stored as, straight from the integers ``k`` it is
    held as (let go from there), where its format packs raw values: ``k`` for a symmetric scheme,
    ``k`` plus the zero point for an asymmetric one by channel or group: the values ``quantize``
    gives the weight they rebuild. None (nothing let go) for the others (fp4 formats, an
    asymmetric tensor or block scheme, values off the grid's range): they go through float."""
    args = scheme.weights
    if args is None or not hasattr(FORMATS.get(format_for(scheme)), "pack"):
        return None
    k = held.grid_values(module, release=False)
    if k is None or (args.is_float and (k.dtype != torch.float8_e4m3fn or not args.symmetric)):
        return None
    if args.is_float:
        held.let_go(module)
        return k
    q = k.to(torch.int16)
    if not args.symmetric:
        zero_point = getattr(module, "weight_zero_point", None)
        rows, columns = q.shape
        size = columns if args.strategy == "channel" else args.group_size if args.strategy == "group" else None
        if (zero_point is None or size is None or columns % size or zero_point.numel() != rows * (columns // size)
                or (zero_point.is_floating_point() and not torch.equal(zero_point, zero_point.round()))):
            return None
        q = q.view(rows, columns // size, size).add_(zero_point.reshape(rows, -1, 1).to(torch.int16)).view(rows, columns)
    low, high = torch.aminmax(q)
    if int(low) < args.q_range[0] or int(high) > args.q_range[1]:
        return None  # off the grid's range: quantize would clamp these
    held.let_go(module)
    return q.to(torch.int8)


def _scheme_key(scheme: QuantizationScheme) -> str:
    data = scheme.to_json()
    data.pop("targets")
    return json.dumps(data, sort_keys=True)


def quantization_config_for(model: nn.Module, save_compressed: bool = True, names: Any = None) -> dict[str, Any] | None:
    """The compressed-tensors ``quantization_config`` of a quantized model, else ``None``. Its
    ``ignore`` lists the linear layers left dense, by module name (what compressed-tensors matches
    in transformers), then the MoE routers (``targets.ROUTER_NAMES``) by their names in the checkpoint
    (``names``, a ``KeyMap``: Mixtral's ``block_sparse_moe.gate``, not transformers 5's
    ``mlp.gate``), which is what vLLM matches: it builds a router as a linear layer, where
    transformers does not."""
    modules = quantized_modules(model)
    kv_cache = kv_cache_scheme_of(model)
    transforms = transform_config_of(model)
    if transforms is not None and not modules:
        raise CheckpointError(
            "the model rotates activations at run time (QuIP, SpinQuant's R4), which only a compressed-tensors "
            "checkpoint's transform_config can carry, and nothing in it is quantized",
            got=f"transform groups {sorted(transforms['config_groups'])} and no quantized module",
            fix="quantize it in the same recipe (a QuantizationModifier or GPTQModifier after the rotation)")
    if not modules and kv_cache is None:
        return None
    quantized = {id(m) for _, m, _ in modules}
    routers = moe_routers(model)
    ignore = [n for n, m in model.named_modules() if is_linear(m) and id(m) not in quantized]
    dense_routers = [n for n, m in model.named_modules() if n in routers and _has_matrix(m) and id(m) not in quantized and n not in ignore]
    if names is not None:
        dense_routers = [names.to_checkpoint(f"{n}.weight").removesuffix(".weight") for n in dense_routers]
    ignore += [n for n in dense_routers if n not in ignore]
    dense = [(n, m) for n, m in model.named_modules() if id(m) not in quantized and not is_linear(m)]
    reached = {id(s): _reached_targets(s, modules, dense) for _, _, s in modules}  # once per scheme, not per module
    named = [(n, reached[id(s)]) for n, _, s in modules]
    schemes = name_experts(named)
    if names is not None:
        schemes = _as_stored([(n, s) for (n, _), s in zip(named, schemes)], names)
    config = quantization_config_of(schemes, ignore, kv_cache, save_compressed)
    if transforms is not None:
        config["transform_config"] = written_transform_config(model, transforms)
        logger.warning(
            "the checkpoint rotates activations at run time (transform_config groups %s): llmpress.load applies them "
            "(vLLM reads transform_config on a GPU, unchecked here; its CPU build 0.32 refuses the file), and transformers + compressed-tensors (0.19, 0.20) "
            "load it without them and compute another function",
            ", ".join(sorted(transforms["config_groups"])))
    return config


def _has_matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def _reached_targets(scheme: QuantizationScheme, modules: list[tuple[str, nn.Module, QuantizationScheme]],
                     dense: list[tuple[str, nn.Module]]) -> QuantizationScheme:
    """``scheme`` without the targets that name only modules it does not quantize: ones llmpress
    left dense (a recipe's ``Embedding`` target: llmpress quantizes linear weights, and
    transformers fails on "'Embedding' object has no attribute 'weight'" where compressed-tensors
    looks for a packed embedding), or ones quantized by another scheme (a module given a smaller
    group than its scheme's, ``quant/groups.py``, is written in a group of its own; a mixed
    choice's group that still named it matched it twice, and compressed-tensors took the group
    that does not divide its inputs). A target that names nothing in memory stays (``Conv1D``
    after quantize-on-load, whose modules are llmpress's runtime ones until transformers builds
    them again)."""
    def elsewhere_only(target: str) -> bool:
        if any(s is scheme and matches(n, m, [target], linear_alias=True) for n, m, s in modules):
            return False
        return (any(matches(n, m, [target]) for n, m in dense)
                or any(matches(n, m, [target], linear_alias=True) for n, m, _ in modules))  # none of them is this scheme's

    kept = [t for t in scheme.targets if not elsewhere_only(t)]
    return scheme if kept == list(scheme.targets) or not kept else scheme.model_copy(update={"targets": kept})


def name_experts(named: list[tuple[str, QuantizationScheme]]) -> list[QuantizationScheme]:
    """``named``'s schemes (one a module), each that quantizes experts given an ``re:`` target
    naming them where it has none: transformers 5 builds an MoE block's experts as one module and
    takes their scheme from the first config group whose ``re:`` target names experts (else the
    first with a name or class target: another group's, where a module took a group of its own).
    Says where the experts are under more than one scheme, which transformers cannot read."""
    all_names = [n for n, _ in named]
    out: dict[int, QuantizationScheme] = {}
    kinds: dict[str, str] = {}
    for key, (scheme, members) in _by_scheme(named).items():
        experts = [n for n in members if EXPERT_NAME.fullmatch(n)]
        out[key] = scheme
        if not experts:
            continue
        kinds.setdefault(_scheme_key(scheme), experts[0])
        if not any(t.startswith("re:") and "experts" in t for t in scheme.targets):
            added = [t for t in name_targets(experts, all_names) if t.startswith("re:") and t not in scheme.targets]
            out[key] = scheme.model_copy(update={"targets": [*scheme.targets, *added]})
    if len(kinds) > 1:
        logger.warning(
            "the experts are quantized under %d schemes (%s, ...): vLLM and llmpress.load read each block's own, but transformers "
            "(5.17-5.25) reads one scheme for all of a model's experts and cannot load this checkpoint. For one it loads, give "
            "every expert one scheme (mixed precision: experts: shared)", len(kinds), ", ".join(list(kinds.values())[:3]))
    return [out[id(scheme)] for _, scheme in named]


def _as_stored(named: list[tuple[str, QuantizationScheme]], names: Any) -> list[QuantizationScheme]:
    """``named``'s schemes, each target that names modules by a path the checkpoint renames
    (``names``, a ``KeyMap``: transformers 5's ``mlp.experts`` for Mixtral's
    ``block_sparse_moe.experts``) joined by targets for the checkpoint's names: vLLM matches
    those, transformers and ``llmpress.load`` the model's. Class targets stay as they are."""
    stored = {n: names.to_checkpoint(f"{n}.weight").removesuffix(".weight") for n, _ in named}
    if all(stored[n] == n for n in stored):
        return [scheme for _, scheme in named]
    out: dict[int, QuantizationScheme] = {}
    for key, (scheme, members) in _by_scheme(named).items():
        added: list[str] = []
        for target in scheme.targets:
            if "." not in target and not target.startswith("re:"):
                continue  # a class name
            pattern = target[3:] if target.startswith("re:") else re.escape(target) + "$"
            reached = [n for n in members if re.match(pattern, n)]
            if reached and not all(re.match(pattern, stored[n]) for n in reached):
                added += [t for t in name_targets([stored[n] for n in reached], list(stored.values())) if t not in scheme.targets + added]
        out[key] = scheme.model_copy(update={"targets": [*scheme.targets, *added]}) if added else scheme
    return [out[id(scheme)] for _, scheme in named]


def _by_scheme(named: list[tuple[str, QuantizationScheme]]) -> dict[int, tuple[QuantizationScheme, list[str]]]:
    """``named`` (module, scheme) by scheme object: the scheme and its modules, in order."""
    groups: dict[int, tuple[QuantizationScheme, list[str]]] = {}
    for name, scheme in named:
        groups.setdefault(id(scheme), (scheme, []))[1].append(name)
    return groups


def quantization_config_of(schemes: list[QuantizationScheme], ignore: list[str], kv_cache: Any = None,
                           save_compressed: bool = True) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` of modules quantized by ``schemes`` (one
    entry a module), the linear layers left dense named in ``ignore``."""
    groups: dict[str, dict[str, Any]] = {}
    for scheme in schemes:
        group = groups.setdefault(_scheme_key(scheme), {**scheme.to_json(), "targets": []})
        group["targets"] += [t for t in scheme.targets if t not in group["targets"]]
    for group in groups.values():
        scheme = QuantizationScheme(**group)
        group["format"] = format_for(scheme) if save_compressed else "dense"
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": (formats.pop() if len(formats) == 1 else "mixed-precision") if formats else "dense",
        "quantization_status": "compressed" if save_compressed else "frozen",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": ignore,
        "kv_cache_scheme": None if kv_cache is None else kv_cache.to_json(),
        "global_compression_ratio": None,
    }
