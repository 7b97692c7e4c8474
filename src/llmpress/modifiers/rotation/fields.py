"""llm-compressor's fields that ``SpinQuantModifier`` and ``QuIPModifier`` share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator

from llmpress.contract.modifier import ModifierConfig
from llmpress.errors import RecipeError

__all__ = ["RotationFields"]


class RotationFields(BaseModel):
    model_config = ModifierConfig.model_config

    randomize: bool = False
    learnable: bool = False
    precision: str | None = None  # llm-compressor's: folding runs in float64 here, run-time rotations in float32
    transform_block_size: int | None = None
    seed: int = 0  # the random rotations' (random-hadamard's signs, random-matrix)

    @field_validator("learnable", "randomize")
    @classmethod
    def _not_yet(cls, value: bool, info: Any) -> bool:
        if value:
            raise RecipeError(f"{cls.__name__.removesuffix('Config')}'s {info.field_name}: true is not supported",
                              got="true", expected="false (as llm-compressor 0.14 also requires)",
                              fix=f"remove {info.field_name}; transform_type: random-hadamard gives seeded random rotations")
        return value
