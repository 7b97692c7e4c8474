"""What llmpress keeps on a model (not on one module) while it works on it.

* the recipe the model was made with (``applied_recipe``): the recipe a checkpoint was loaded
  with, followed by the stages sessions applied since; every save writes it as ``recipe.yaml``;
* the finished layers' weights held as integers past calibration (``held_weights``): a run that
  saves and lets the model go writes them from the integers, one module at a time;
* the quantizer that loaded the model (``loading_quantizer``).

They are one object on the model (``ModelRecord``, its ``llmpress_record``), as a module's are
one ``ModuleState``. The floors above read and write it through the functions here, so the save
path needs neither the recipe parser nor the pipeline that holds the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    import torch

__all__ = ["HeldWeights", "ModelRecord", "applied_recipe", "config_entry", "held_weights", "keep_held_weights", "loading_quantizer", "record_loading_quantizer",
           "record_recipe", "record_transform_group", "release_held_weights", "transform_config_of"]

_RECORD = "llmpress_record"


def config_entry(config: Any, key: str) -> dict[str, Any] | None:
    """What an algorithm wrote into a model config under ``key`` (mixed precision's choice,
    AutoRound's losses), from the config object or a config.json dict; None when absent."""
    entry = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return entry if isinstance(entry, dict) else None


@dataclass(eq=False)
class ModelRecord:
    """What llmpress keeps on a model (one attribute, ``llmpress_record``)."""

    recipe: Any = None  # the Recipe it was made with so far
    held: HeldWeights | None = None
    quantizer: Any = None
    #: compressed-tensors' ``transform_config`` (a ``TransformConfig`` as JSON) of the rotations the
    #: model applies at run time (``llmpress.transforms``), for the checkpoint
    transforms: dict[str, Any] | None = None


def _record(model: nn.Module, create: bool = False) -> ModelRecord | None:
    record = model.__dict__.get(_RECORD)
    if record is None and create:
        record = model.__dict__[_RECORD] = ModelRecord()
    return record


class HeldWeights(Protocol):
    """Finished layers' weights held as integers (``pipelines/storage/compact.py``)."""

    def weight_of(self, module: nn.Module, release: bool = True) -> torch.Tensor | None: ...

    def grid_values(self, module: nn.Module, release: bool = True) -> torch.Tensor | None: ...

    def let_go(self, module: nn.Module) -> None: ...

    def integers_of(self, layer: nn.Module) -> dict[nn.Module, torch.Tensor]: ...


def applied_recipe(model: nn.Module) -> Any:
    """The ``Recipe`` the model was made with so far, or None."""
    record = _record(model)
    return None if record is None else record.recipe


def record_recipe(model: nn.Module, recipe: Any) -> None:
    """The model was made with ``recipe`` (a ``Recipe``: what it was loaded with plus what was
    applied since)."""
    _record(model, create=True).recipe = recipe


def held_weights(model: nn.Module) -> HeldWeights | None:
    """What holds some of ``model``'s weights as integers past calibration, if anything."""
    record = _record(model)
    return None if record is None else record.held


def keep_held_weights(model: nn.Module, held: HeldWeights) -> None:
    _record(model, create=True).held = held


def release_held_weights(model: nn.Module, held: HeldWeights) -> None:
    """``held`` no longer holds any of the model's weights."""
    record = _record(model)
    if record is not None and record.held is held:
        record.held = None


def loading_quantizer(model: nn.Module) -> Any:
    """The ``Quantizer`` ``llmpress.load`` loaded the model with, or None."""
    record = _record(model)
    return None if record is None else record.quantizer


def record_loading_quantizer(model: nn.Module, quantizer: Any) -> None:
    _record(model, create=True).quantizer = quantizer


def transform_config_of(model: nn.Module) -> dict[str, Any] | None:
    """The ``transform_config`` of the rotations ``model`` applies at run time, or None."""
    record = _record(model)
    return None if record is None or not record.transforms else {"config_groups": dict(record.transforms)}


def record_transform_group(model: nn.Module, name: str, scheme: Any) -> None:
    """``model`` applies transform group ``name`` (a ``TransformScheme``, or its JSON)."""
    record = _record(model, create=True)
    record.transforms = {**(record.transforms or {}), name: scheme if isinstance(scheme, dict) else scheme.model_dump(mode="json")}
