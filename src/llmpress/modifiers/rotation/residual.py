"""Where a model's rotations go, found from the model, with no table of architectures.

- **R1, the residual stream** (size ``hidden``): in each block, the norms and the Linears reading
  them are the smoothing mappings found by data flow (``smoothing/mappings.py``: one forward of
  the block, checked by running); their gains fold into those readers, which take ``W Q``. The
  writers are the block's other column readers whose output is ``hidden`` wide (``o_proj``,
  ``down_proj``, every expert's ``down_proj``): ``Qᵀ W``. Outside the blocks: the input
  embeddings (``E Q``), and the final norm folded into the output head, which takes ``W Q``
  (tied to the embeddings, the head is untied first).
- **R2, per head** (size ``head_dim``): ``v_proj``'s rows of each head ``Hᵀ W``, ``o_proj``'s
  columns of each head ``W H``; grouped KV heads share ``H``, so every query head sees its KV head
  rotated alike. A fused ``qkv_proj`` (Phi-3) takes it on its v rows, the last ``(out - q) / 2``,
  ``q`` being ``o_proj``'s input width.

Each block is checked by running once per structure: its rotated version on the rotated input
must give the rotated output of the original on the original input. A model where that fails (a
norm after ``o_proj``, as Gemma 2's, scales the stream after the writer) is refused with the
measured difference, the block put back as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmpress.contract.block import CalibrationBlock, hidden_of, structure_of
from llmpress.contract.observation import primary_input, with_primary_input
from llmpress.errors import UnsupportedModelError
from llmpress.models.experts import mixing_all_experts
from llmpress.models.linear import input_major
from llmpress.modifiers.quantization.modifier import untie_shared_weights
from llmpress.modifiers.rotation.fold import fold_gain_and_rotate_inputs, rotate_embedding, rotate_outputs, unit_gain
from llmpress.modifiers.smoothing.mappings import MappingMemo, find_mappings, reads_columns
from llmpress.targets import matches
from llmpress.transforms.hadamard import Rotation

__all__ = ["FUSED_QKV", "BlockPlan", "head_dim_of", "plan_block", "rotate_block", "rotate_ends"]

#: a fused q/k/v projection whose last rows are v's (Phi-3's)
FUSED_QKV = r"re:(.*\.)?qkv_proj$"


@dataclass
class BlockPlan:
    """What one block's rotations touch."""

    norms: list[tuple[nn.Module, list[nn.Module]]] = field(default_factory=list)  # R1: norm -> its readers
    writers: list[nn.Module] = field(default_factory=list)  # R1: written into the stream
    heads: list[tuple[nn.Module, tuple[int, int] | None, nn.Module]] = field(default_factory=list)  # R2: (v, its v rows, o)
    skipped: list[str] = field(default_factory=list)


def _rows_out(module: nn.Module) -> int:
    return module.weight.shape[-1] if input_major(module) else module.weight.shape[0]


def _flow(block: CalibrationBlock) -> tuple[dict[int, int], dict[int, nn.Module]]:
    """One forward of the block on its first batch: the memory of the tensor each submodule was
    called on (by the module's id; not for a module that gives its input back), and which column
    reader produced each output (by memory, so views count)."""
    consumed: dict[int, int] = {}
    produced: dict[int, nn.Module] = {}
    keep: list[torch.Tensor] = []  # alive for the pass: no address is reused
    handles = []
    for module in block.module.modules():
        if module is block.module:
            continue

        def before(mod, args, kwargs):
            x = primary_input(args, kwargs)
            if isinstance(x, torch.Tensor):
                consumed.setdefault(id(mod), x.data_ptr())
                keep.append(x)

        def after(mod, args, output):
            out = hidden_of(output)
            if isinstance(out, torch.Tensor) and consumed.get(id(mod)) == out.data_ptr() and not reads_columns(mod):
                del consumed[id(mod)]  # gave its input back (a dropout when not training): it reads nothing
            if isinstance(out, torch.Tensor) and reads_columns(mod):
                produced.setdefault(out.data_ptr(), mod)
                keep.append(out)

        handles += [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]
    try:
        with mixing_all_experts(block.module):
            block.run(block.module, block.inputs[:1])
    finally:
        for handle in handles:
            handle.remove()
    return consumed, produced


def plan_block(block: CalibrationBlock, prefix: str, hidden: int, r1: bool, r2: bool, v_pattern: str, o_pattern: str,
               memo: MappingMemo) -> BlockPlan:
    """R1: the norms of the stream (their input made by no Linear: the block's input, or a sum
    with it) with their readers, and the writers (column readers ``hidden`` wide whose output
    no submodule reads: it goes into the stream). R2: each ``v_pattern`` Linear with the one
    ``o_pattern`` Linear beside it."""
    plan = BlockPlan()
    if r1:
        mappings, plan.skipped = find_mappings(block, prefix, [], linear_sources=False, memo=memo)
        consumed, produced = _flow(block)
        plan.norms = [(m.smooth, list(m.balance)) for m in mappings
                      if not isinstance(m.smooth, nn.Linear) and consumed.get(id(m.smooth)) not in produced]
        readers = {id(r) for _, rs in plan.norms for r in rs}
        plan.writers = []
        for module in block.module.modules():
            if module is block.module or not reads_columns(module) or id(module) in readers or _rows_out(module) != hidden:
                continue
            made = [ptr for ptr, m in produced.items() if m is module]
            if made and not set(made) & set(consumed.values()):
                plan.writers.append(module)
    if r2:
        named = dict(block.module.named_modules())
        for name, v in named.items():
            fused = matches(prefix + name, v, [FUSED_QKV])
            if not (isinstance(v, nn.Linear) and (fused or matches(prefix + name, v, [v_pattern]))):
                continue
            parent = name.rpartition(".")[0]
            siblings = [m for n, m in named.items() if n.rpartition(".")[0] == parent and isinstance(m, nn.Linear)
                        and matches(prefix + n, m, [o_pattern])]
            if len(siblings) != 1:
                continue
            o = siblings[0]
            kv = (v.out_features - o.in_features) // 2
            if not fused:
                plan.heads.append((v, None, o))
            elif kv > 0 and v.out_features == o.in_features + 2 * kv:
                plan.heads.append((v, (v.out_features - kv, v.out_features), o))
    return plan


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in module.named_parameters()}


def _restore(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for name, param in module.named_parameters():
        param.data = saved[name]


def _added(block: CalibrationBlock, batch: tuple[tuple, dict], x: torch.Tensor) -> torch.Tensor:
    """What the block adds to ``x``: its output minus its input, in float64."""
    args, kwargs = with_primary_input(*batch, x)
    with mixing_all_experts(block.module):
        out = hidden_of(block.run(block.module, [(args, kwargs)])[0])
    return out.double() - x.double()


def rotate_block(block: CalibrationBlock, plan: BlockPlan, r1: Rotation | None, r2: Rotation | None,
                 checked: dict[tuple, bool]) -> None:
    """Apply the plan's rotations to the block (its input is already the rotated stream), checked
    by running for the first block of each structure (``checked``)."""
    structure = structure_of(block.module)
    check = structure not in checked and bool(block.inputs)
    if check:
        saved = _snapshot(block.module)
        batch = block.inputs[0]
        rotated_input = primary_input(*batch)
        plain = r1.rows(rotated_input.double(), transpose=True).to(rotated_input.dtype) if r1 else rotated_input
        expected = _added(block, batch, plain)
        if r1 is not None:
            expected = r1.rows(expected)
    for norm, readers in plan.norms:
        gain = unit_gain(norm)
        for reader in readers:
            fold_gain_and_rotate_inputs(reader, gain, r1)
    for writer in plan.writers:
        rotate_outputs(writer, r1)
    if r2 is not None:
        for v, rows, o in plan.heads:
            rotate_outputs(v, _sized(r2, rows[1] - rows[0] if rows else v.out_features), rows)
            fold_gain_and_rotate_inputs(o, None, _sized(r2, o.in_features))
    if check:
        got = _added(block, batch, rotated_input)
        tolerance = 1e-4 if rotated_input.dtype == torch.float32 else 3e-2
        error = ((got - expected).norm() / expected.norm().clamp(min=1e-12)).item()
        if error > tolerance:
            _restore(block.module, saved)
            raise UnsupportedModelError(
                f"rotating block {block.index} of this model changes what it computes",
                got=f"a relative difference of {error:.2g} in what the block adds to its input (at most {tolerance:g} allowed)",
                expected="a residual stream read through RMS norms and written by Linears (Llama, Mistral, Qwen, Gemma, "
                         "their MoE versions)",
                fix="leave R1 out of rotations (R2 needs only v_proj / o_proj), or rotate another model",
            )
        checked[structure] = True


def _sized(rotation: Rotation, size: int) -> Rotation:
    """The per-head rotation ``rotation`` for ``size`` values (heads x head_dim), the same ``H``."""
    if size % rotation.width:
        raise UnsupportedModelError(f"a projection of {size} values is not a whole number of heads of {rotation.width}",
                                    got=str(size), expected=f"a multiple of the head size {rotation.width}")
    return rotation if rotation.size == size else Rotation(size, rotation.kind, rotation.seed, rotation.width)


def _final_norm(model: nn.Module, blocks: nn.ModuleList, hidden: int) -> nn.Module:
    """The norm between the blocks and the head: the one module outside the blocks with a
    ``hidden``-wide 1-D ``weight`` (``model.norm``, ``final_layernorm``...)."""
    inside = set(blocks.modules())
    found = [(n, m) for n, m in model.named_modules() if m not in inside and not isinstance(m, (nn.Embedding, nn.Linear))
             and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1 and m.weight.numel() == hidden]
    if len(found) != 1:
        raise UnsupportedModelError(
            "R1 folds the final norm into the output head and found no single such norm",
            got=", ".join(n for n, _ in found) or "none",
            expected="one norm between the blocks and the head",
        )
    if isinstance(getattr(found[0][1], "bias", None), torch.Tensor):
        raise UnsupportedModelError("R1 needs RMS norms: a norm with a bias (LayerNorm) does not commute with a rotation",
                                    got=f"{found[0][0]} ({type(found[0][1]).__name__})", expected="RMSNorm")
    return found[0][1]


def rotate_ends(model: nn.Module, blocks: nn.ModuleList, r1: Rotation, embedding_pattern: str | None = None,
                head_pattern: str | None = None) -> list[str]:
    """R1 outside the blocks: the input embeddings, the final norm into the head, the head.
    Returns what it did, for the log."""
    named = dict(model.named_modules())
    embedding = next((m for n, m in named.items() if embedding_pattern and matches(n, m, [embedding_pattern])),
                     model.get_input_embeddings())
    head = next((m for n, m in named.items() if head_pattern and matches(n, m, [head_pattern])), model.get_output_embeddings())
    if head is None or not reads_columns(head):
        raise UnsupportedModelError("R1 rotates the residual stream up to the output head, and this model has none",
                                    got=type(model).__name__, expected="a causal LM with an output head (lm_head)")
    done = ["untied the output head from the embeddings"] if untie_shared_weights(model, [head], "rotated") else []
    rotate_embedding(embedding, r1)
    norm = _final_norm(model, blocks, r1.size)
    fold_gain_and_rotate_inputs(head, unit_gain(norm), r1)
    done.append("rotated the embeddings and the head, the final norm folded into it")
    return done


def head_dim_of(model: nn.Module) -> int:
    """The attention head size from the model's config."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    size = getattr(config, "head_dim", None)
    if not size and config is not None and getattr(config, "num_attention_heads", None):
        size = config.hidden_size // config.num_attention_heads
    if not size:
        raise UnsupportedModelError("R2 rotates each attention head and found no head size in the config",
                                    got=type(model).__name__, expected="config.head_dim or hidden_size / num_attention_heads")
    return int(size)

