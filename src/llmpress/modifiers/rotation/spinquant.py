"""``SpinQuantModifier``: rotations folded into the weights before they are quantized (QuaRot,
Ashkboos et al. 2024; SpinQuant, Liu et al. 2024), in llm-compressor's fields.

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        SpinQuantModifier:
          rotations: [R1, R2]
          transform_type: hadamard
        GPTQModifier:
          scheme: W4A16
          targets: [Linear]
          ignore: [lm_head]

``R1`` rotates the residual stream (embeddings, every reader and writer of it, the head; the
norms' gains folded into their readers), ``R2`` each attention head between ``v_proj`` and
``o_proj`` (``residual.py`` says how each is found and checked). Both fold into the weights: the
model computes the same function and the checkpoint is an ordinary one that vLLM and
transformers load unchanged, while the outliers a quantizer meets are spread over every channel.
``R4`` rotates ``down_proj``'s input (the one a 4-bit activation quantizer meets with the largest
outliers): ``W Q`` is folded and the model computes ``x Q`` at run time, written into the
checkpoint's ``transform_config`` (``llmpress.transforms``), which ``llmpress.load`` applies (vLLM
reads it on a GPU; its CPU build 0.32 refuses it) and transformers + compressed-tensors ignore (the save says so).
The quantizers of the stage then calibrate the rotated blocks (GPTQ's Hessians are of rotated
inputs).

Rotations happen where each part's turn comes: the embeddings and the head at
``calibration_start``, each block at ``block_start`` (a block is read when its turn comes, so
memory stays one block). Finding a block's norms runs the block once: on the calibration data
when the recipe has some, else (a data-free scheme after it) on one batch of seeded random
tokens. ``R3`` (queries and keys rotated alike after RoPE, which changes nothing unless the KV
cache is quantized) and ``learnable`` rotations (SpinQuant's Cayley optimisation) are refused
with that reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from llmpress.contract.block import find_blocks
from llmpress.contract.modifier import MODIFIERS, Modifier, ModifierConfig, OneShotFields, State
from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.modifiers.rotation.fields import RotationFields
from llmpress.modifiers.rotation.residual import head_dim_of, plan_block, rotate_block, rotate_ends
from llmpress.modifiers.smoothing.mappings import MappingMemo
from llmpress.targets import matches
from llmpress.transforms.apply import GroupMatrices, apply_group
from llmpress.transforms.config import TransformArgs, TransformScheme
from llmpress.transforms.hadamard import Rotation

if TYPE_CHECKING:
    from torch import nn

    from llmpress.contract.block import CalibrationBlock

__all__ = ["SpinQuantMapping", "SpinQuantModifier", "SpinQuantModifierConfig"]

logger = logging.getLogger(__name__)

ONLINE = {"R3": "rotates queries and keys alike after RoPE at run time, which changes nothing unless the KV cache is quantized"}


class SpinQuantMapping(BaseModel):
    """llm-compressor's names for the parts it rotates. llmpress finds R1's readers and writers
    by data flow; ``embedding``, ``lm_head``, ``attn_v`` and ``attn_o`` are used, the rest are
    accepted so that its recipes run unchanged."""

    model_config = ConfigDict(extra="forbid")

    embedding: str = "re:.*embed_tokens$"
    attn: str = "re:.*self_attn$"
    attn_q: str = "re:.*q_proj$"
    attn_k: str = "re:.*k_proj$"
    attn_v: str = r"re:(.*\.)?v_proj$"  # llm-compressor's "re:.*v_proj$" also names a fused qkv_proj
    attn_o: str = r"re:(.*\.)?o_proj$"
    attn_head_dim: int | None = None
    mlp_in: list[str] = ["re:.*up_proj$", "re:.*gate_proj$"]
    mlp_out: list[str] = ["re:.*down_proj$"]
    lm_head: str = "lm_head"


class SpinQuantModifierConfig(ModifierConfig, RotationFields, OneShotFields):
    rotations: list[str] = ["R1", "R2"]
    transform_type: Literal["hadamard", "random-hadamard", "random-matrix"] = "hadamard"
    mappings: SpinQuantMapping | None = None
    norm_mappings: list[dict[str, Any]] | None = None  # accepted: the norms are found by data flow
    transform_config: dict[str, Any] | None = None

    @field_validator("rotations", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        names = [str(v).upper() for v in ([value] if isinstance(value, str) else value)]
        for name in names:
            if name in ONLINE:
                raise RecipeError(f"SpinQuantModifier's {name} is an online rotation ({ONLINE[name]}) and is not built yet",
                                  got=str(value), expected="R1, R2 (folded into the weights) and R4 (down_proj's input, at run time)",
                                  fix=f"leave {name} out of rotations")
            if name not in ("R1", "R2", "R4"):
                raise ValueError(f"unknown rotation {name!r} (R1, R2, R3, R4)")
        if not names:
            raise ValueError("rotations is empty")
        return list(dict.fromkeys(names))

    @field_validator("transform_config")
    @classmethod
    def _no_config(cls, value: Any) -> Any:
        if value:
            raise RecipeError("SpinQuantModifier's transform_config is not read: the rotations are found from the model",
                              got="a transform_config", fix="remove transform_config")
        return value


@MODIFIERS.register("SpinQuantModifier")
class SpinQuantModifier(Modifier):
    Config = SpinQuantModifierConfig
    #: it gathers no statistic: every rank rotates its copy alike (a rank's batches only find the
    #: norms' readers, and each rank checks its own blocks)
    reduces_across_ranks = True
    #: a block's forward only finds its norms and their readers: without calibration data
    #: (SpinQuant + FP8_DYNAMIC, say) a one-shot run makes it on seeded random tokens
    structure_from_any_tokens = True

    def on_initialize(self, state: State) -> None:
        config = self.config
        self.mapping = config.mappings or SpinQuantMapping()
        model = state.model
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embedding is None:
            raise UnsupportedModelError("SpinQuantModifier rotates a language model's residual stream",
                                        got=type(model).__name__, expected="a model with input embeddings")
        self.hidden = embedding.weight.shape[-1]
        kind, seed, block = config.transform_type, config.seed, config.transform_block_size
        self.r1 = Rotation(self.hidden, kind, seed, block) if "R1" in config.rotations else None
        self.r2 = None
        if "R2" in config.rotations:
            self.r2 = Rotation(self.mapping.attn_head_dim or head_dim_of(model), kind, seed + 1)
        self.r4 = None
        if "R4" in config.rotations:  # x Q online before down_proj, W Q folded (llm-compressor's R4 group)
            outs = self.mapping.mlp_out
            self.r4 = GroupMatrices(TransformScheme(type=kind, head_dim=block, apply=[
                TransformArgs(targets=outs, location="input"), TransformArgs(targets=outs, location="weight_input", inverse=True)]),
                seed + 2)
        self.prefix_of = {m: f"{n}." for n, m in model.named_modules()}
        self.memo = MappingMemo()
        self.checked: dict[tuple, bool] = {}
        self.blocks = 0

    def on_calibration_start(self, state: State) -> None:
        blocks = find_blocks(state.model)
        if blocks is None:
            raise UnsupportedModelError("SpinQuantModifier rotates a model block by block and found no repeated blocks",
                                        got=type(state.model).__name__, expected="a list of decoder layers")
        if self.r1 is not None:
            for line in rotate_ends(state.model, blocks, self.r1, self.mapping.embedding, self.mapping.lm_head):
                logger.info("SpinQuantModifier: %s", line)

    def on_block_start(self, state: State, block: CalibrationBlock) -> None:
        prefix = self.prefix_of.get(block.module, "")
        plan = plan_block(block, prefix, self.hidden, self.r1 is not None, self.r2 is not None,
                          self.mapping.attn_v, self.mapping.attn_o, self.memo)
        if self.r1 is not None and not plan.norms:
            raise UnsupportedModelError(f"SpinQuantModifier found no norm feeding a Linear in block {block.index}",
                                        got="; ".join(plan.skipped) or "no candidate", expected="RMS norms before the attention and MLP")
        if self.r2 is not None and not plan.heads and self.blocks == 0:
            logger.warning("SpinQuantModifier: no %s / %s pair in block %d: R2 skipped", self.mapping.attn_v,
                           self.mapping.attn_o, block.index)
        rotate_block(block, plan, self.r1, self.r2, self.checked)
        r4 = self._rotate_down(block, prefix, state.model)
        if self.blocks == 0:
            logger.info("SpinQuantModifier, block %d: %d norms folded into their readers, %d writers, %d attention v / o pairs, "
                        "%d down_proj inputs rotated at run time%s", block.index, len(plan.norms), len(plan.writers), len(plan.heads), r4,
                        f" (skipped: {'; '.join(plan.skipped)})" if plan.skipped else "")
        self.blocks += 1

    def _rotate_down(self, block: CalibrationBlock, prefix: str, model: nn.Module, online_only: bool = False) -> int:
        """R4 on the block's ``down_proj`` (``mlp_out``) Linears: how many."""
        if self.r4 is None:
            return 0
        modules = [(prefix + n, m) for n, m in block.module.named_modules() if matches(prefix + n, m, self.mapping.mlp_out)]
        apply_group("R4", self.r4.scheme, modules, self.r4, model, online_only)  # both entries target exactly these
        return len(modules)

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        """A resumed run put ``block`` back rotated: R4's run-time half is attached again."""
        self._rotate_down(block, self.prefix_of.get(block.module, ""), state.model, online_only=True)
        self.blocks += 1

    def on_calibration_end(self, state: State) -> None:
        if self.blocks == 0:
            raise UnsupportedModelError(
                "SpinQuantModifier rotates a model block by block and was given no block",
                got=f"{type(state.model).__name__}, calibrated without blocks (the 'basic' pipeline, or no repeated layers found)",
                expected="the layerwise pipeline (the default) on a model with a list of repeated layers",
            )
        logger.info("SpinQuantModifier: %s on %d blocks", " and ".join(self.config.rotations), self.blocks)
