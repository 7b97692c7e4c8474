"""What users write for ``GPTQModifier``: the scheme fields plus GPTQ's own; ``start`` / ``end``
only as llm-compressor's one-shot recipes give them."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator

from llmpress.contract.modifier import OneShotFields
from llmpress.errors import RecipeError
from llmpress.modifiers.quantization.config import SchemeFields
from llmpress.quant.scheme import ActivationOrdering

__all__ = ["GPTQModifierConfig"]


class GPTQModifierConfig(SchemeFields, OneShotFields):
    scheme_from_stage: ClassVar[bool] = True  # no scheme: the stage's QuantizationModifier gives it

    block_size: int = 128
    dampening_frac: float = 0.01
    #: the column order where a scheme names none (llm-compressor 0.14's default); null: left to right
    actorder: ActivationOrdering | None = ActivationOrdering.STATIC
    offload_hessians: bool = False
    # Accepted so that recipes saved by llm-compressor run unchanged. llmpress always quantizes
    # modules that share a Hessian as one matrix and needs calibration data for GPTQ.
    batched_quantization: Literal["auto"] | int | None = "auto"
    requires_calibration_data: Literal[True] = True

    @model_validator(mode="after")
    def _check_gptq(self) -> GPTQModifierConfig:
        if self.block_size < 1:
            raise RecipeError("GPTQModifier: block_size must be positive", got=self.block_size, expected=">= 1 (e.g. 128)")
        if not 0 <= self.dampening_frac < 1:
            raise RecipeError(
                "GPTQModifier: dampening_frac must be in [0, 1)",
                got=self.dampening_frac,
                expected="a small fraction of the mean Hessian diagonal, e.g. 0.01",
            )
        if self.actorder == ActivationOrdering.GROUP or any(
            s.weights is not None and s.weights.actorder == ActivationOrdering.GROUP for s in self.resolved_schemes()
        ):
            raise RecipeError(
                "actorder 'group' needs a g_idx tensor that compressed-tensors no longer reads",
                got="actorder: group",
                expected="actorder: weight, static or null",
                fix="use actorder: weight (reorders columns during GPTQ only; nothing extra is stored)",
            )
        return self
