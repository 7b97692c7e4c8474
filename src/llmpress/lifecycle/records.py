"""What llmpress keeps on a model (not on one module) while it works on it.

* the recipe the model was made with (``applied_recipe``): the recipe a checkpoint was loaded
  with, followed by the stages sessions applied since; every save writes it as ``recipe.yaml``;
* the finished layers' weights held as integers past calibration (``held_weights``): a run that
  saves and lets the model go writes them from the integers, one module at a time;
* the quantizer that loaded the model (``loading_quantizer``).

The floors above read and write these through the functions here, so the save path needs
neither the recipe parser nor the pipeline that holds the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    import torch

__all__ = ["HeldWeights", "applied_recipe", "held_weights", "keep_held_weights", "loading_quantizer", "record_loading_quantizer",
           "record_recipe", "release_held_weights"]

_RECIPE = "_llmpress_applied_recipe"
_HELD = "_llmpress_held_weights"
_QUANTIZER = "llmpress_quantizer"


class HeldWeights(Protocol):
    """Finished layers' weights held as integers (``pipelines/storage/compact.py``)."""

    def weight_of(self, module: nn.Module, release: bool = True) -> torch.Tensor | None: ...

    def integers_of(self, layer: nn.Module) -> dict[nn.Module, torch.Tensor]: ...


def applied_recipe(model: nn.Module) -> Any:
    """The ``Recipe`` the model was made with so far, or None."""
    return getattr(model, _RECIPE, None)


def record_recipe(model: nn.Module, recipe: Any) -> None:
    """The model was made with ``recipe`` (a ``Recipe``: what it was loaded with plus what was
    applied since)."""
    setattr(model, _RECIPE, recipe)


def held_weights(model: nn.Module) -> HeldWeights | None:
    """What holds some of ``model``'s weights as integers past calibration, if anything."""
    return getattr(model, _HELD, None)


def keep_held_weights(model: nn.Module, held: HeldWeights) -> None:
    setattr(model, _HELD, held)


def release_held_weights(model: nn.Module, held: HeldWeights) -> None:
    """``held`` no longer holds any of the model's weights."""
    if getattr(model, _HELD, None) is held:
        delattr(model, _HELD)


def loading_quantizer(model: nn.Module) -> Any:
    """The ``Quantizer`` ``llmpress.load`` loaded the model with, or None."""
    return getattr(model, _QUANTIZER, None)


def record_loading_quantizer(model: nn.Module, quantizer: Any) -> None:
    setattr(model, _QUANTIZER, quantizer)
