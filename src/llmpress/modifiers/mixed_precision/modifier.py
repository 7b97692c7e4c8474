"""``MixedPrecisionModifier``: a scheme per module from a menu, to fit a size.

Example recipe (GPTQ after it quantizes what it chose, as GPTQ takes the scheme of a
QuantizationModifier before it; alone, it rounds to nearest)::

    quant_stage:
      quant_modifiers:
        MixedPrecisionModifier:
          average_bits: 4.25            # or size: 60MB (the whole checkpoint)
          schemes: [W3A16, W4A16, W4A16_G32, W8A16, DENSE]
          ignore: [lm_head]
        GPTQModifier: {}

The same choice is ``mixed_precision: {average_bits: 4.25, schemes: [...]}`` on any quantizing
modifier. Sensitivities are measured on the model as its stage starts: put rotations in an
earlier stage, so that the choice sees the rotated weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import model_validator

from llmpress.contract.modifier import MODIFIERS
from llmpress.errors import RecipeError
from llmpress.modifiers.mixed_precision.menu import MixedPrecision
from llmpress.modifiers.quantization.config import QuantizationModifierConfig, SchemeFields
from llmpress.modifiers.quantization.modifier import QuantizationModifier

if TYPE_CHECKING:
    from llmpress.recipe.recipe import Recipe

__all__ = ["MixedPrecisionModifier", "MixedPrecisionModifierConfig", "with_command_line_choice", "with_mixed_precision"]

_CHOICE_FIELDS = ("average_bits", "size", "schemes", "samples", "experts")
_SCHEME_CHOICES = ("scheme", "config_groups", "mixed_precision")


class MixedPrecisionModifierConfig(QuantizationModifierConfig):
    """``QuantizationModifier``'s fields, with the mixed-precision choice's own at the top level
    (``average_bits`` or ``size``, ``schemes``, ``samples``, ``experts``)."""

    @model_validator(mode="before")
    @classmethod
    def _choice_fields(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        fields = dict(value)
        choice = {k: fields.pop(k) for k in _CHOICE_FIELDS if k in fields}
        if choice or "mixed_precision" not in fields:
            fields["mixed_precision"] = {**(fields.get("mixed_precision") or {}), **choice}
        return fields


@MODIFIERS.register("MixedPrecisionModifier")
class MixedPrecisionModifier(QuantizationModifier):
    Config = MixedPrecisionModifierConfig


def with_mixed_precision(recipe: Recipe, mixed: MixedPrecision) -> Recipe:
    """``recipe`` with every quantizing modifier's scheme replaced by ``mixed``'s choice (what
    ``llmpress oneshot --average-bits`` / ``--target-size`` does to the recipe it is given)."""
    changed = 0
    for stage in recipe.stages:
        for modifiers in stage.groups.values():
            for i, modifier in enumerate(modifiers):
                config = modifier.config
                if not isinstance(config, SchemeFields) or not config.has_scheme:
                    continue
                fields = {k: v for k, v in config.model_dump(exclude_defaults=True).items() if k not in _SCHEME_CHOICES}
                modifiers[i] = type(modifier)(**fields, mixed_precision=mixed.model_dump(exclude_defaults=True))
                changed += 1
    if not changed:
        raise RecipeError("mixed precision needs a quantizing modifier in the recipe to choose its schemes",
                          got=[type(m).__name__ for m in recipe.modifiers],
                          expected="a recipe with QuantizationModifier or GPTQModifier", fix="e.g. --recipe W4A16")
    return recipe


def with_command_line_choice(recipe: Recipe, average_bits: float | None = None, size: str | None = None, schemes: str | None = None,
                             experts: str | None = None) -> Recipe:
    """``recipe`` as ``llmpress oneshot --average-bits / --target-size`` (with ``--schemes`` and
    ``--experts``) turns it into a mixed one; as it is without a target, where those two are refused."""
    if average_bits is None and size is None:
        if schemes is not None or experts is not None:
            raise RecipeError("--schemes and --experts shape the mixed-precision choice of --average-bits / --target-size",
                              got=" ".join(f"--{k} {v}" for k, v in (("schemes", schemes), ("experts", experts)) if v is not None),
                              expected="a target beside them", fix="add --average-bits 4.25 or --target-size 60MB (a recipe's "
                              "mixed_precision takes schemes and experts as its own fields)")
        return recipe
    choice = {"average_bits": average_bits, "size": size, "schemes": schemes, "experts": experts}
    return with_mixed_precision(recipe, MixedPrecision(**{k: v for k, v in choice.items() if v is not None}))
