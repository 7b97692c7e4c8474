"""What a data-free recipe does to a checkpoint, decided from its tensors' names and shapes alone.

The model-class path matches a recipe's targets against modules; here they are matched against
the names of the checkpoint's weights. A linear layer is a 2-D floating ``<module>.weight`` that
is not an embedding (a module whose last name holds ``embed``, or ``wte`` / ``wpe`` / ``shared``)
nor a mixture-of-experts router of transformers 5 (``<mlp>.gate`` beside ``<mlp>.experts``): on
the architectures llmpress supports (``tests/model_free``) that is exactly the set of modules
``assign_schemes`` quantizes, and the two paths write the same tensors. Where the names cannot
say (a target that is a class other than ``Linear``, GPT-2's transposed ``Conv1D``, experts
fused into one 3-D tensor, a tied head the recipe quantizes, checkpoint names that are not the
model's (GPT-NeoX, multimodal models), a checkpoint that is quantized already, but for Hugging
Face fp8 ones, whose weights are read dense) ``plan_model_free`` raises ``ModelFreeRefused`` with the reason, and ``oneshot`` loads
the model instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmpress.errors import RecipeError
from llmpress.formats.hf_fp8 import DROPPED_NAMES, SCALE_NAME, check_fp8_source
from llmpress.lifecycle.attach import FUSED_NAMES
from llmpress.modifiers.quantization import QuantizationModifier
from llmpress.quant.groups import dividing_groups
from llmpress.quant.scheme import QuantizationScheme
from llmpress.recipe import Recipe
from llmpress.targets import CLASS, EXACT, REGEX, ROUTER_NAMES
from llmpress.tensorfiles.dtypes import named_dtype
from llmpress.tensorfiles.read import ShardEntry
from llmpress.tensorfiles.verify import sound_shards

__all__ = ["ModelFreePlan", "ModelFreeRefused", "plan_model_free"]

#: model types whose linear layers are transformers' Conv1D ([in, out]): the names cannot say so
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
#: model types whose checkpoint names a module other than the model does (GPT-NeoX's embed_out is lm_head)
RENAMED_MODEL_TYPES = frozenset({"gpt_neox", "gpt_neox_japanese", "phimoe"})  # phimoe: its router
_EMBEDDING = re.compile(r"(embed|^wte$|^wpe$|^shared$)")


class ModelFreeRefused(RecipeError):
    """The recipe or the checkpoint needs the model class (the reason is the message)."""


@dataclass
class ModelFreePlan:
    folder: Path
    config: dict[str, Any]
    shards: dict[Path, list[ShardEntry]]
    #: each quantized weight's name -> its scheme
    schemes: dict[str, QuantizationScheme]
    #: NVFP4 weights -> the names of their fused family (q/k/v, gate/up), which share a global scale
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: the linear layers left dense, as the saved config lists them
    ignore: list[str] = field(default_factory=list)
    #: what unquantized tensors and scales are written in (None: each tensor's own)
    dtype: torch.dtype | None = None
    #: a Hugging Face fp8 source (``formats/hf_fp8.py``): each fp8 weight -> its scale's name, the
    #: block size, and the dtype its weights are dequantized to (the model's)
    fp8_weights: dict[str, str] = field(default_factory=dict)
    fp8_block: list[int] | None = None
    fp8_dtype: torch.dtype = torch.bfloat16

    def skipped(self, name: str) -> bool:
        """A tensor of the source the output does not carry (an fp8 source's scales)."""
        owner, _, local = name.rpartition(".")
        return bool(self.fp8_weights) and f"{owner}.weight" in self.fp8_weights and local in (SCALE_NAME, *DROPPED_NAMES)


def plan_model_free(folder: Path, recipe: Recipe, dtype: torch.dtype | None = None) -> ModelFreePlan:
    """The plan for ``recipe`` on the checkpoint in ``folder``, or ``ModelFreeRefused``."""
    modifier = _data_free_modifier(recipe)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    stored = config.get("quantization_config")
    if stored is not None and stored.get("quant_method") != "fp8":
        raise ModelFreeRefused("the checkpoint is quantized already: it is read through the model class",
                               got=stored.get("quant_method"), expected="a full-precision or Hugging Face fp8 checkpoint")
    if config.get("model_type") in CONV1D_MODEL_TYPES:
        raise ModelFreeRefused(f"{config['model_type']} stores its linear layers transposed (Conv1D)", got=config["model_type"])
    if config.get("model_type") in RENAMED_MODEL_TYPES or "text_config" in config:
        raise ModelFreeRefused("the checkpoint's tensor names are not the model's module names (a multimodal or renamed layout)",
                               got=config.get("model_type"))
    shards = sound_shards(folder)  # headers, index and config against the weights
    entries = {e.name: e for es in shards.values() for e in es}
    linear = _linear_modules(entries)
    _refuse_fused_experts(entries)
    schemes_of = modifier.config.resolved_schemes()
    ignore = modifier.config.ignore
    chosen: dict[str, QuantizationScheme] = {}
    routers = _routers(entries)  # as assign_by_targets: Linear does not reach a router; a name or pattern reaches a `router`
    for module in linear:
        if _priority(module, ignore) is not None:
            continue
        best = None
        for scheme in schemes_of:
            priority = _priority(module, [t for t in scheme.targets if t != "Linear" or module not in routers])
            if priority is not None and (best is None or priority < best[0]):
                best = (priority, scheme)
        if best is not None:
            chosen[f"{module}.weight"] = best[1]
    if not chosen:
        raise ModelFreeRefused("the recipe matches none of the checkpoint's linear weights by name",
                               got=f"targets {[t for s in schemes_of for t in s.targets]}",
                               expected=f"targets that match weights such as {sorted(linear)[:3]}")
    fitted = dividing_groups({n.removesuffix(".weight"): (s, entries[n].shape[-1]) for n, s in chosen.items()}, type(modifier).__name__)
    chosen = {f"{module}.weight": scheme for module, scheme in fitted.items()}  # as assign_schemes fits them
    heads = any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in config.get("architectures") or [])
    tied_head = heads and "lm_head" not in linear and config.get("tie_word_embeddings", True)
    dense = [m for m in linear if f"{m}.weight" not in chosen] + [r for r in routers if r not in linear]  # as the model path lists them
    if tied_head and "lm_head" not in dense:
        if _priority("lm_head", ignore) is None and any(_priority("lm_head", s.targets) is not None for s in schemes_of):
            raise ModelFreeRefused("the recipe quantizes a head tied to the embeddings: it is untied in the model first",
                                   got="lm_head shares the embedding weight", fix="ignore lm_head, or load the model")
        dense.append("lm_head")
    plan = ModelFreePlan(folder, config, shards, chosen, _families(chosen), _in_module_order(dense, entries), dtype)
    if stored is not None:  # a Hugging Face fp8 source: its weights are read dense
        plan.fp8_block = check_fp8_source(stored)
        plan.fp8_weights = {f"{name[: -len(SCALE_NAME) - 1]}.weight": name for name in entries if name.endswith(f".{SCALE_NAME}")}
        plan.fp8_dtype = dtype or named_dtype(config.get("dtype") or config.get("torch_dtype"), torch.bfloat16)  # fp8 checkpoints are made from bf16
    return plan


def _data_free_modifier(recipe: Recipe) -> QuantizationModifier:
    """The recipe's one QuantizationModifier, when it needs no calibration data."""
    modifiers = recipe.modifiers
    if len(recipe.stages) != 1 or len(modifiers) != 1 or not isinstance(modifiers[0], QuantizationModifier):
        raise ModelFreeRefused("only a recipe of one QuantizationModifier runs without the model",
                               got=[type(m).__name__ for m in modifiers])
    modifier = modifiers[0]
    if modifier.config.needs_calibration:
        raise ModelFreeRefused("the recipe calibrates static activation scales or a KV cache: it needs data and the model",
                               got="static input activations or kv_cache_scheme")
    if modifier.window.is_timed:
        raise ModelFreeRefused("the recipe trains (a start / end window)", got="start / end")
    for pattern in [*modifier.config.ignore, *(t for s in modifier.config.resolved_schemes() for t in s.targets)]:
        if not pattern.startswith("re:") and pattern[:1].isupper() and pattern != "Linear":
            raise ModelFreeRefused("a target or ignore entry names a module class, which tensor names cannot match",
                                   got=pattern, expected="Linear, module names or re: patterns")
    return modifier


def _linear_modules(entries: dict[str, ShardEntry]) -> list[str]:
    """The modules of the checkpoint's linear weights, in file order: an MoE block's ``gate`` is not
    one (transformers 5 builds it as a router of its own, not a Linear); a ``router`` is."""
    routers = _experts_blocks(entries)
    found = []
    for name, entry in entries.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(entry.shape) != 2 or not entry.dtype.is_floating_point or not module:
            continue
        last = module.rpartition(".")[2]
        if _EMBEDDING.search(last) or (last == "gate" and module.rpartition(".")[0] in routers):
            continue
        found.append(module)
    return found


def _routers(entries: dict[str, ShardEntry]) -> list[str]:
    """The MoE routers with a 2-D weight beside their ``experts`` (``targets.ROUTER_NAMES``)."""
    return [f"{b}.{leaf}" for b in sorted(_experts_blocks(entries)) for leaf in ROUTER_NAMES
            if (e := entries.get(f"{b}.{leaf}.weight")) is not None and len(e.shape) == 2]


def _experts_blocks(entries: dict[str, ShardEntry]) -> set[str]:
    """The modules that hold ``experts`` (an MoE block)."""
    return {name.rpartition(".experts.")[0] for name in entries if ".experts." in name}


def _refuse_fused_experts(entries: dict[str, ShardEntry]) -> None:
    """Weights of 3 dimensions or more that are not convolutions: experts fused into one tensor."""
    fused = [n for n, e in entries.items() if len(e.shape) >= 3 and e.dtype.is_floating_point
             and not re.search(r"(conv|patch|embed)", n.rpartition(".")[0].rpartition(".")[2])]
    if fused:
        raise ModelFreeRefused("the experts are fused into 3-D tensors, which the model splits into linear layers first",
                               got=fused[0])


def _priority(module: str, patterns: list[str]) -> int | None:
    """``targets.match_priority`` on a name: a linear layer is of class ``Linear``."""
    best = None
    for pattern in patterns:
        found = (REGEX if re.match(pattern[3:], module) else None) if pattern.startswith("re:") else \
            EXACT if pattern == module else CLASS if pattern == "Linear" else None
        if found is not None and (best is None or found < best):
            best = found
    return best


def _families(chosen: dict[str, QuantizationScheme]) -> dict[str, tuple[str, ...]]:
    """NVFP4 weights and their fused siblings (all NVFP4), as ``attach.fused_families`` groups modules."""
    families: dict[str, tuple[str, ...]] = {}
    parents = {name.rsplit(".", 2)[0] for name in chosen}
    for parent in parents:
        for names in FUSED_NAMES:
            members = tuple(f"{parent}.{n}.weight" for n in names)
            if all(m in chosen and chosen[m].weights is not None and chosen[m].weights.has_global_scale for m in members):
                families.update(dict.fromkeys(members, members))
    return families


def _in_module_order(modules: list[str], entries: dict[str, ShardEntry]) -> list[str]:
    """Module names in the order the model would list them (by layer number, then file order)."""
    order = {name.rpartition(".")[0]: i for i, name in enumerate(entries)}

    def key(module: str) -> tuple:
        return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", module)), order.get(module, 0)

    return sorted(modules, key=key)
