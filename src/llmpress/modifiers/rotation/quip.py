"""``QuIPModifier``: a rotation on each side of every targeted Linear (QuIP, Chee et al. 2023;
QuIP#, Tseng et al. 2024), in llm-compressor's fields.

Example recipe (llm-compressor's, unchanged)::

    quant_stage:
      quant_modifiers:
        QuIPModifier:
          rotations: [v]
          transform_type: random-hadamard
        QuantizationModifier:
          scheme: W4A4
          targets: [Linear]
          ignore: [lm_head]

``v`` rotates each Linear's input: the weight becomes ``W V`` (folded) and the model computes
``x V`` at run time; ``u`` rotates its output: ``Uᵀ W`` folded and ``y Uᵀ`` at run time. The
rotations spread outliers over every channel of what the quantizer sees, weights and inputs
alike. The run-time halves are written into the checkpoint's ``transform_config``
(``llmpress.transforms``), which ``llmpress.load`` applies (vLLM reads it on a GPU; its CPU
build 0.32 refuses it); transformers + compressed-tensors (0.19, 0.20) ignore it and compute another
function, which the save says.

Each block is rotated when its turn comes (``block_start``), Linears outside the blocks at
``calibration_start``; a quantizer after it calibrates the rotated weights on rotated inputs.
``transform_config`` (compressed-tensors' JSON) replaces what the other fields would build.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import field_validator

from llmpress.contract.block import find_blocks
from llmpress.contract.modifier import MODIFIERS, Modifier, ModifierConfig, OneShotFields, State
from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.modifiers.rotation.fields import RotationFields
from llmpress.targets import matches
from llmpress.transforms.apply import GroupMatrices, apply_group
from llmpress.transforms.config import TransformArgs, TransformConfig, TransformScheme

if TYPE_CHECKING:
    from torch import nn

    from llmpress.contract.block import CalibrationBlock

__all__ = ["QuIPModifier", "QuIPModifierConfig"]

logger = logging.getLogger(__name__)


class QuIPModifierConfig(ModifierConfig, RotationFields, OneShotFields):
    rotations: list[Literal["v", "u"]] = ["v"]
    transform_type: Literal["hadamard", "random-hadamard", "random-matrix"] = "random-hadamard"
    targets: list[str] | str = "Linear"
    ignore: list[str] | str = "lm_head"
    transform_config: dict[str, Any] | None = None

    @field_validator("rotations", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        names = [value] if isinstance(value, str) else value
        return [str(v).lower() for v in names]

    def build(self) -> TransformConfig:
        """The ``transform_config`` these fields stand for (``transform_config`` itself when given)."""
        if self.transform_config:
            try:
                return TransformConfig.model_validate(self.transform_config)
            except ValueError as exc:
                raise RecipeError("QuIPModifier's transform_config is not compressed-tensors' TransformConfig",
                                  got=str(exc).splitlines()[0]) from None
        targets = [self.targets] if isinstance(self.targets, str) else self.targets
        ignore = [self.ignore] if isinstance(self.ignore, str) else self.ignore

        def scheme(first: str, second: str, inverse_first: bool) -> TransformScheme:
            return TransformScheme(type=self.transform_type, head_dim=self.transform_block_size, apply=[
                TransformArgs(targets=targets, location=first, inverse=inverse_first, ignore=ignore),
                TransformArgs(targets=targets, location=second, inverse=not inverse_first, ignore=ignore)])

        groups = {}
        if "v" in self.rotations:  # x V online, W V folded
            groups["v"] = scheme("input", "weight_input", False)
        if "u" in self.rotations:  # Uᵀ W folded, y Uᵀ online
            groups["u"] = scheme("weight_output", "output", False)
        return TransformConfig(config_groups=groups)


@MODIFIERS.register("QuIPModifier")
class QuIPModifier(Modifier):
    Config = QuIPModifierConfig
    #: it gathers nothing: every rank rotates its copy alike
    reduces_across_ranks = True

    def on_initialize(self, state: State) -> None:
        self.transforms = self.config.build()
        for group, scheme in self.transforms.config_groups.items():
            for args in scheme.apply:
                if args.location in ("q_attn", "k_cache"):
                    raise RecipeError(f"QuIPModifier's transform_config group {group!r} rotates {args.location}, which is not built",
                                      got=args.location, expected="input, output, weight_input or weight_output")
        self.matrices = {g: GroupMatrices(s, self.config.seed + i) for i, (g, s) in enumerate(self.transforms.config_groups.items())}
        self.prefix_of = {m: f"{n}." for n, m in state.model.named_modules()}
        self.blocks = 0

    def _apply(self, modules: list[tuple[str, nn.Module]], model: nn.Module | None = None, online_only: bool = False) -> int:
        return sum(apply_group(group, scheme, modules, self.matrices[group], model, online_only)
                   for group, scheme in self.transforms.config_groups.items())

    def on_calibration_start(self, state: State) -> None:
        blocks = find_blocks(state.model)
        if blocks is None:
            raise UnsupportedModelError("QuIPModifier rotates a model block by block and found no repeated blocks",
                                        got=type(state.model).__name__, expected="a list of decoder layers")
        inside = {id(m) for block in blocks for m in block.modules()}
        outside = [(n, m) for n, m in state.model.named_modules() if id(m) not in inside]
        head = state.model.get_output_embeddings() if hasattr(state.model, "get_output_embeddings") else None
        if getattr(getattr(state.model, "config", None), "tie_word_embeddings", False) and head is not None:
            for name, module in outside:
                if module is head and any(matches(name, module, a.targets, linear_alias=True) and not matches(name, module, a.ignore, linear_alias=True)
                                          for s in self.transforms.config_groups.values() for a in s.apply):
                    raise RecipeError("QuIPModifier would rotate the output head, whose weight is the input embeddings' (tied)",
                                      got=name, fix="add it to ignore (llm-compressor's default is lm_head)")
        count = self._apply(outside, state.model)
        if count:
            logger.info("QuIPModifier: %d rotation(s) outside the blocks", count)

    def on_block_start(self, state: State, block: CalibrationBlock) -> None:
        self._rotate(block)

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        """A resumed run put ``block`` back with its weights rotated: the run-time halves only."""
        self._rotate(block, online_only=True)

    def _rotate(self, block: CalibrationBlock, online_only: bool = False) -> None:
        prefix = self.prefix_of.get(block.module, "")
        count = self._apply([(prefix + n, m) for n, m in block.module.named_modules()], online_only=online_only)
        if self.blocks == 0:
            logger.info("QuIPModifier, block %d: %d rotation(s) (%s)", block.index, count, ", ".join(self.transforms.config_groups))
        self.blocks += 1

    def on_calibration_end(self, state: State) -> None:
        if self.blocks == 0:
            raise UnsupportedModelError("QuIPModifier rotates a model block by block and was given no block",
                                        got=f"{type(state.model).__name__}, calibrated without blocks",
                                        expected="the layerwise pipeline (the default) on a model with a list of repeated layers")
        logger.info("QuIPModifier: %s on %d blocks", " and ".join(self.transforms.config_groups), self.blocks)
