"""Smoothing mappings: a layer whose output channels can absorb ``1/s`` and the Linears that read
that output, whose input columns take ``s`` (SmoothQuant, AWQ).

llm-compressor keeps a table of mappings per architecture and fails on models it lacks. Here they
are read from the block itself, with no table:

- **by data flow**: one forward of the block records which module produced each tensor and which
  Linears (or GPT-2's Conv1D, or routers) read it; a norm (a module with a per-channel
  ``weight``) or a Linear whose output is the very input of some Linears (or a view of it) is a
  candidate with those Linears
  (``input_layernorm`` → q/k/v; an MoE's ``post_attention_layernorm`` → its router and every
  expert's gate/up, while all experts calibrate on all tokens, the default);
- **through the attention or the gated MLP**: with ``linear_sources``, a Linear run before
  another in the same module, whose output width is the other's input width, where that input
  came from no recorded module (``v_proj`` → ``o_proj`` without grouped KV heads, ``up_proj`` →
  ``down_proj``), or a multiple of it: one part of a fused Linear's rows (Phi-3's
  ``gate_up_proj[256:512]`` → ``down_proj``, ``qkv_proj``'s v rows → ``o_proj``), each part
  tried by the check below;
- **checked by running**: every candidate is applied with random positive scales, the block run
  once more and compared with its output, and the weights put back exactly. A mapping that
  changes the block's function (``gate_proj`` → ``down_proj`` through the activation, a norm
  output that also feeds the residual) is dropped and said why.

The scales are folded by ``fold.apply_scales`` (Gemma's ``1 + weight`` norms included).

A recipe's mappings, in llm-compressor's syntax (``[[balance patterns], smooth pattern]``), are
resolved inside each block and checked the same way.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmpress.compat import own_parameters
from llmpress.contract.block import hidden_of, structure_of
from llmpress.contract.observation import primary_input
from llmpress.models.experts import LinearExperts, mixing_all_experts
from llmpress.models.linear import input_major
from llmpress.modifiers.smoothing.fold import apply_scales
from llmpress.targets import matches

__all__ = ["Mapping", "MappingMemo", "find_mappings", "reads_columns", "resolve_mappings"]


def reads_columns(module: nn.Module) -> bool:
    """Whether the module multiplies its input by a 2-D ``weight``: a Linear (``[out, in]``),
    GPT-2's Conv1D (``[in, out]``), or a router that calls ``F.linear`` with its own weight
    (Qwen3-MoE's, DeepSeek's), so its input channels can take ``s`` as a Linear's do."""
    if isinstance(module, nn.Linear) or input_major(module):
        return True
    weight = own_parameters(module).get("weight") if isinstance(module, nn.Module) else None
    return weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)


def _columns(module: nn.Module) -> int:
    """How many input channels the module reads."""
    return module.weight.shape[0] if input_major(module) else module.weight.shape[-1]


@dataclass
class Mapping:
    smooth_name: str
    smooth: nn.Module
    balance_names: list[str]
    balance: list[nn.Linear] = field(repr=False)
    #: the smooth Linear's output rows that take ``1/s`` when it is fused (Phi-3's ``gate_up_proj``:
    #: its up half feeds ``down_proj``); None: all of them
    rows: tuple[int, int] | None = None

    def describe(self) -> str:
        """``post_attention_layernorm -> gate, experts.*.gate_proj, experts.*.up_proj (4 experts)``,
        ``gate_up_proj[256:512] -> down_proj``"""
        parent = self.smooth_name.rpartition(".")[0]
        local = [n.removeprefix(parent + ".") if parent else n for n in self.balance_names]  # the names inside the block
        inner = []
        for name in local:
            pattern = re.sub(r"\.\d+\.", ".*.", name)
            short = ".".join(pattern.split(".")[-3:]) if "*" in pattern else pattern.rsplit(".", 1)[-1]
            if short not in inner:
                inner.append(short)
        experts = {m.group(1) for n in local if (m := re.search(r"\.(\d+)\.", n))}
        more = f" ({len(experts)} experts)" if len(experts) > 1 else ""
        rows = f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else ""
        return f"{self.smooth_name.rsplit('.', 1)[-1]}{rows} -> {', '.join(inner)}{more}"

    def balance_seeing_every_token(self, block: nn.Module) -> list[nn.Module]:
        """The balance layers that see every token of a batch: those that are not experts (a
        router, a shared expert, q/k/v), then the experts of ``block`` that run on every token
        while calibrating (``LinearExperts.calibrate_all``, as ``calibrating_all_experts`` sets
        it), whose input is then the smooth layer's whole output."""
        plain = [m for n, m in zip(self.balance_names, self.balance) if not re.search(r"\.experts\.\d+\.", n)]
        everyone = {m for experts in block.modules() if isinstance(experts, LinearExperts) and experts.calibrate_all
                    for m in experts.modules() if m is not experts}
        return plain + [m for m in self.balance if m in everyone]


def _per_channel_weight(module: nn.Module, width: int) -> bool:
    """Whether the module's output channels can be divided by ``s``: a Linear (its rows), or a
    module with a 1-D ``weight`` of the output's width (a norm)."""
    if isinstance(module, nn.Linear):
        return module.out_features == width
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == width


def _fused(module: nn.Module, width: int) -> bool:
    """A Linear with several ``width``-row parts (``gate_up_proj``, a ``qkv_proj`` without
    grouped KV heads), one of which may feed the balance layers."""
    return isinstance(module, nn.Linear) and module.out_features > width and module.out_features % width == 0


def _parts(mapping: Mapping, width: int) -> list[Mapping]:
    """The mapping once per ``width``-row part of its fused smooth Linear, the last part first
    (the up half of ``gate_up_proj``, the v rows of ``qkv_proj``: where the part a product or
    the attention passes on sits in the models seen)."""
    count = mapping.smooth.out_features // width
    return [Mapping(mapping.smooth_name, mapping.smooth, mapping.balance_names, mapping.balance, (k * width, (k + 1) * width))
            for k in reversed(range(count))]


def _record_flow(block: Any) -> tuple[dict[int, tuple[str, nn.Module]], dict[str, torch.Tensor], dict[int, torch.Tensor], dict[str, int]]:
    """One forward of the block on its first batch: the innermost module that produced each
    output tensor (by id), each column reader's input, and the modules that ran, in the order
    they finished."""
    produced: dict[int, tuple[str, nn.Module]] = {}
    keep: dict[int, torch.Tensor] = {}  # the tensors, so their ids stay theirs during the pass
    inputs: dict[str, torch.Tensor] = {}
    called: dict[str, int] = {}  # each module that ran, by when it first finished
    handles = []
    for name, module in block.module.named_modules():
        def after(mod, args, output, name=name):
            called.setdefault(name, len(called))
            if isinstance(output, torch.Tensor) and id(output) not in produced:
                produced[id(output)] = (name, mod)  # children's hooks fire first: the innermost wins
                keep[id(output)] = output
            if reads_columns(mod) and args and isinstance(args[0], torch.Tensor) and args[0].shape[-1] == _columns(mod):
                first = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(mod, nn.Linear) or input_major(mod) or (isinstance(first, torch.Tensor) and first.shape[-1] == mod.weight.shape[0]):
                    inputs[name] = args[0]  # a router: x @ W.T, its output as wide as W has rows
                    keep[id(args[0])] = args[0]

        handles.append(module.register_forward_hook(after))
    try:
        block.run(block.module, block.inputs[:1])
    finally:
        for handle in handles:
            handle.remove()
    return produced, inputs, keep, called


def _through_views(produced: dict[int, tuple[str, nn.Module]], inputs: dict[str, torch.Tensor],
                   keep: dict[int, torch.Tensor]) -> dict[int, int]:
    """For each Linear input, the id of the tensor it stands for: itself, or the produced tensor
    it is a view of (same memory, elements, last dimension and stride). An MoE block reads its
    norm's output through views: ``view(-1, hidden)`` in its router and, calibrating all experts,
    in every expert, while a shared expert may read the output itself; all of them read one
    tensor."""
    def where(t: torch.Tensor) -> tuple[int, ...]:
        return t.data_ptr(), t.numel(), t.shape[-1], t.stride(-1)

    by_memory: dict[tuple[int, ...], int] = {}
    for i, t in keep.items():
        if i in produced:
            by_memory.setdefault(where(t), i)  # the first producer: the innermost module
    return {id(x): id(x) if id(x) in produced else by_memory.get(where(x), id(x)) for x in inputs.values()}


def _candidates(block: Any, linear_sources: bool) -> tuple[list[Mapping], list[str]]:
    produced, inputs, keep, called = _record_flow(block)
    canonical = _through_views(produced, inputs, keep)
    modules = dict(block.module.named_modules())
    readers: dict[int, list[str]] = {}
    for name, x in inputs.items():
        readers.setdefault(canonical[id(x)], []).append(name)
    found: list[Mapping] = []
    skipped: list[str] = []
    for tensor_id, names in readers.items():
        source = produced.get(tensor_id)
        if source is None:
            continue
        smooth_name, smooth = source
        width = keep[tensor_id].shape[-1]
        if isinstance(smooth, nn.Linear) and not linear_sources:
            continue
        if _per_channel_weight(smooth, width) and smooth_name not in names:
            mapping = Mapping(smooth_name, smooth, names, [modules[n] for n in names])
            # a reader that did not run on this batch (an expert no token reached, a branch for
            # other inputs) cannot be seen to read the same tensor: the mapping would miss it
            scope = os.path.commonprefix([n.split(".") for n in names]) if len(names) > 1 else names[0].split(".")[:-1]
            under = ".".join(scope) + "." if scope else ""
            idle = [n for n, m in modules.items() if n not in called and n.startswith(under) and reads_columns(m)
                    and _columns(m) == width]
            if idle:
                skipped.append(f"{mapping.describe()} ({idle[0]} did not run on the first batch)")
            else:
                found.append(mapping)
    if linear_sources:  # through attention or a gated product: no module produced the input
        for reader, x in inputs.items():
            if canonical[id(x)] in produced or not isinstance(modules[reader], nn.Linear):
                continue
            parent = reader.rpartition(".")[0]
            for name, linear in modules.items():  # a Linear run before it in the same module (v_proj -> o_proj)
                if (isinstance(linear, nn.Linear) and name != reader and name.rpartition(".")[0] == parent
                        and linear.out_features % x.shape[-1] == 0 and called.get(name, len(called)) < called[reader]):
                    found.append(Mapping(name, linear, [reader], [modules[reader]]))
    return found, skipped


@torch.no_grad()
def keeps_function(block: Any, mapping: Mapping, reference: torch.Tensor, start: torch.Tensor | None) -> bool:
    """Apply random positive scales, run the block on its first batch, put the weights back:
    whether the output stayed the same (the mapping is safe to fold). What the block adds to its
    input (``reference - start``) is compared, not its output, which the residual stream
    dominates: in bf16 a correct mapping moves it by well under 1%, a wrong one (through an
    activation) by 5% or more; in float32 the bound is 1e-4."""
    touched = [mapping.smooth, *mapping.balance]
    saved = [{k: v.detach().clone() for k, v in m.named_parameters(recurse=False)} for m in touched]
    width = _columns(mapping.balance[0])
    scales = torch.empty(width).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(width))
    try:
        apply_scales(mapping, scales)
        with mixing_all_experts(block.module):  # as the reference: every expert counts
            out = hidden_of(block.run(block.module, block.inputs[:1])[0])
    except RuntimeError:  # the scales do not even fit (a shape the checks above missed)
        return False
    finally:
        for module, params in zip(touched, saved):
            for name, value in params.items():
                getattr(module, name).data.copy_(value)
    tolerance = 1e-4 if reference.dtype == torch.float32 else 2e-2
    added = reference.float() - (start.float() if start is not None and start.shape == reference.shape else 0)
    return bool((out.float() - reference.float()).norm() <= tolerance * added.norm().clamp(min=1e-12))


class MappingMemo:
    """What the blocks of one structure share (the same module names, classes and parameter
    shapes: a model's repeated layers): the candidates found by data flow, and whether each
    keeps the function when scaled. Only the first block of each structure runs the block to
    find and check them; what depends on the block's place (ignored names, an earlier stage's
    quantization) is still decided per block. An MoE block finds its candidates itself (which
    experts its first batch reached is its own), and reuses the checks."""

    def __init__(self) -> None:
        self.candidates: dict[tuple, tuple[list[tuple[str, list[str]]], list[str]]] = {}
        self.verdicts: dict[tuple, bool] = {}


def _checked(block: Any, candidates: list[Mapping], ignore: list[str], prefix: str,
             skipped: list[str] | None = None, memo: MappingMemo | None = None,
             structure: tuple | None = None) -> tuple[list[Mapping], list[str]]:
    """The candidates that keep the block's function when scaled, checked with every expert of
    an MoE block mixed into the output (``mixing_all_experts``: an expert this batch routes no
    token to still counts). A mapping whose smooth layer, or every balance layer, is ignored is
    left out; ignored balance layers among others take the scales (the function needs them) and
    are not quantized. ``memo``: checks a block of the same structure (``structure_of(block)``,
    passed when the caller has it) made are not run again."""
    if memo is not None and structure is None:
        structure = structure_of(block.module)
    outputs: list[torch.Tensor] = []  # the block's output on its first batch, once a check needs it

    def keeps(mapping: Mapping) -> bool:
        key = (structure, mapping.smooth_name, tuple(mapping.balance_names), mapping.rows)
        if memo is not None and key in memo.verdicts:
            return memo.verdicts[key]
        if not outputs:
            with mixing_all_experts(block.module):
                outputs.append(hidden_of(block.run(block.module, block.inputs[:1])[0]))
        start = primary_input(*block.inputs[0])
        verdict = keeps_function(block, mapping, outputs[0], start if isinstance(start, torch.Tensor) else None)
        if memo is not None:
            memo.verdicts[key] = verdict
        return verdict

    kept, skipped = [], list(skipped or [])
    smooths: set[int] = set()
    balanced: set[int] = set()
    for mapping in candidates:
        if id(mapping.smooth) in smooths:  # one mapping per smooth layer: its scales are applied once
            skipped.append(f"{mapping.describe()} (its smooth layer is in an earlier mapping)")
            continue
        if any(id(m) in balanced for m in mapping.balance):  # nor twice to one balance layer
            skipped.append(f"{mapping.describe()} (a balance layer is in an earlier mapping)")
            continue
        full = [f"{prefix}{n}" for n in [mapping.smooth_name, *mapping.balance_names]]
        modules = [mapping.smooth, *mapping.balance]
        ignored = [matches(n, m, ignore) for n, m in zip(full, modules)]
        if ignored[0] or all(ignored[1:]):
            continue
        widths = {_columns(m) for m in mapping.balance}
        width = widths.pop() if len(widths) == 1 else 0
        fused = mapping.rows is None and _fused(mapping.smooth, width)
        if not width or not (fused or _per_channel_weight(mapping.smooth, width)):
            skipped.append(f"{mapping.describe()} (its output width is not the balance layers' input width)")
        elif any(getattr(m, name, None) is not None for m in modules for name in ("weight_scale", "input_scale")):
            skipped.append(f"{mapping.describe()} (an earlier stage quantized it already)")
        elif chosen := next((m for m in (_parts(mapping, width) if fused else [mapping]) if keeps(m)), None):
            kept.append(Mapping(full[0], mapping.smooth, full[1:], mapping.balance, chosen.rows))
            smooths.add(id(mapping.smooth))
            balanced.update(id(m) for m in mapping.balance)
        else:
            what = "scaling any part of its rows" if fused else "scaling it"
            skipped.append(f"{mapping.describe()} ({what} changes the block's output)")
    return kept, skipped


def find_mappings(block: Any, prefix: str, ignore: list[str], linear_sources: bool = False,
                  memo: MappingMemo | None = None) -> tuple[list[Mapping], list[str]]:
    """The block's mappings found by data flow and checked by running, with full names
    (``prefix`` + the name inside the block), and the candidates dropped (why). ``memo``: what
    an earlier block of the same structure found is used, not found again."""
    structure = structure_of(block.module) if memo is not None else None
    key = (linear_sources, structure)
    if memo is not None and key in memo.candidates:
        found, skipped = memo.candidates[key]
        modules = dict(block.module.named_modules())
        candidates = [Mapping(smooth, modules[smooth], list(names), [modules[n] for n in names]) for smooth, names in found]
    else:
        candidates, skipped = _candidates(block, linear_sources)
        if memo is not None and not any(isinstance(m, LinearExperts) for m in block.module.modules()):
            memo.candidates[key] = ([(m.smooth_name, list(m.balance_names)) for m in candidates], list(skipped))
    return _checked(block, candidates, ignore, prefix, skipped, memo, structure)


def resolve_mappings(block: Any, prefix: str, patterns: list[tuple[list[str], str]], ignore: list[str],
                     memo: MappingMemo | None = None) -> tuple[list[Mapping], list[str]]:
    """A recipe's mappings ``[[balance patterns], smooth pattern]`` in this block: each smooth
    layer the pattern matches, with the Linears matching the balance patterns under its closest
    ancestor that has any; checked by running as found ones are."""
    named = {n: m for n, m in block.module.named_modules() if n}
    candidates = []
    for balance_patterns, smooth_pattern in patterns:
        for smooth_name, smooth in named.items():
            if not matches(prefix + smooth_name, smooth, [smooth_pattern]):
                continue
            scope = smooth_name
            while True:
                scope = scope.rpartition(".")[0]
                under = {n: m for n, m in named.items() if reads_columns(m) and (not scope or n.startswith(scope + "."))
                         and any(matches(prefix + n, m, [p]) for p in balance_patterns)}
                if under or not scope:
                    break
            under.pop(smooth_name, None)
            if under:
                candidates.append(Mapping(smooth_name, smooth, list(under), list(under.values())))
    return _checked(block, candidates, ignore, prefix, memo=memo)
