"""``MagnitudePruningModifier``: gradual magnitude pruning during training.

Sparsity rises from ``init_sparsity`` to ``final_sparsity`` between ``start`` and ``end``
(epochs) on the cubic schedule of Zhu & Gupta (2017)::

    s(p) = final + (init - final) * (1 - p) ** 3,   p = progress through the window in [0, 1]

or on another of llm-compressor's (``update_scheduler``: ``linear``, ``polynomial_decay`` and
``polynomial`` with ``scheduler_args: {exponent: 2}``, ``multi_step`` with ``scheduler_args:
{steps: [[epoch, sparsity], ...]}``). After each optimizer step the masks are recomputed from
the weights' magnitudes (every ``update`` epochs, or every step; ``update_frequency`` is read as
``update``) and applied, so training moves the surviving weights while the pruned ones stay
zero. ``mask_structure: "2:4"`` keeps 2 of every 4 inputs (N:M)::

    MagnitudePruningModifier:
      targets: ['re:.*proj$']
      init_sparsity: 0.05
      final_sparsity: 0.5
      start: 0
      end: 1
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import AliasChoices, Field, field_validator, model_validator
from torch import nn

from llmpress.contract.modifier import MODIFIERS, Modifier, State, WindowFields
from llmpress.lifecycle.sparsity import mark_sparse, sparsity_of
from llmpress.models.linear import linear_weight
from llmpress.modifiers.pruning.masks import (
    magnitude_mask,
    parse_structure,
    prunable_modules,
)
from llmpress.parallel.fsdp import like, whole

__all__ = ["MagnitudePruningModifier", "cubic_sparsity"]

logger = logging.getLogger(__name__)


def cubic_sparsity(progress: float, init: float, final: float) -> float:
    return final + (init - final) * (1.0 - progress) ** 3


SCHEDULERS = ("cubic", "linear", "polynomial_decay", "polynomial", "multi_step")


def scheduled_sparsity(config: MagnitudePruningConfig, progress: float, epoch: float) -> float:
    """The sparsity ``config``'s schedule asks for ``progress`` through its window (``epoch``:
    where ``multi_step`` reads its steps), as llm-compressor's schedulers compute it."""
    init, final, args = config.init_sparsity, config.final_sparsity, config.scheduler_args
    if config.update_scheduler == "cubic":
        return cubic_sparsity(progress, init, final)
    if config.update_scheduler == "multi_step":
        reached = [sparsity for at, sparsity in sorted(args.get("steps", [])) if epoch >= at]
        return reached[-1] if reached else init
    exponent = float(args.get("exponent", 2))
    shaped = {"linear": progress, "polynomial_decay": 1.0 - (1.0 - progress) ** exponent,
              "polynomial": progress ** exponent}[config.update_scheduler]
    return init + (final - init) * shaped


class MagnitudePruningConfig(WindowFields):
    targets: list[str] = ["Linear"]
    ignore: list[str] = ["lm_head"]
    init_sparsity: float = 0.0
    final_sparsity: float
    end: float  # a schedule needs an end
    update: float | None = Field(None, validation_alias=AliasChoices("update", "update_frequency"))  # epochs between mask updates; None: every step
    update_scheduler: str = "cubic"
    scheduler_args: dict[str, Any] = {}
    mask_structure: str = "unstructured"
    leave_enabled: bool = True  # keep the final masks after `end` until finalize
    apply_globally: bool = False  # llm-compressor's field; it refuses True too

    def llm_compressor_requires(self) -> dict[str, Any]:
        """Its required fields, and ``leave_enabled``, whose default there is False."""
        return {"targets": list(self.targets), "init_sparsity": self.init_sparsity, "final_sparsity": self.final_sparsity,
                "leave_enabled": self.leave_enabled}

    @field_validator("update_scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        if value not in SCHEDULERS:
            raise ValueError(f"update_scheduler must be one of {', '.join(SCHEDULERS)}, got {value!r}")
        return value

    @field_validator("apply_globally")
    @classmethod
    def _per_layer(cls, value: bool) -> bool:
        if value:
            raise ValueError("apply_globally: one threshold over all layers is not implemented (nor in llm-compressor): "
                             "each layer is pruned to the schedule's sparsity; leave apply_globally out")
        return value

    @field_validator("init_sparsity", "final_sparsity")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 <= value < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {value}")
        return value

    @field_validator("mask_structure")
    @classmethod
    def _structure(cls, value: str) -> str:
        parse_structure(value)
        return value.strip()

    @model_validator(mode="after")
    def _check_schedule(self) -> MagnitudePruningConfig:
        if self.init_sparsity > self.final_sparsity:
            raise ValueError(f"init_sparsity {self.init_sparsity} is above final_sparsity {self.final_sparsity}")
        structure = parse_structure(self.mask_structure)
        if structure is not None and self.final_sparsity > 1 - structure[0] / structure[1] + 1e-9:
            n, m = structure
            raise ValueError(f"{n}:{m} masks reach at most {1 - n / m:.2f} sparsity, got final_sparsity {self.final_sparsity}")
        return self


@MODIFIERS.register("MagnitudePruningModifier")
class MagnitudePruningModifier(Modifier):
    Config = MagnitudePruningConfig

    def on_initialize(self, state: State) -> None:
        self.structure = parse_structure(self.config.mask_structure)
        self.modules: dict[str, nn.Module] = prunable_modules(
            state.model, self.config.targets, self.config.ignore, type(self).__name__, self.structure
        )
        self.masks: dict[str, torch.Tensor] = {}
        self.sparsity = 0.0  # the schedule's current target
        self.last_update: float | None = None
        label = self.config.mask_structure if self.structure else "unstructured"
        for module in self.modules.values():
            mark_sparse(module, label)

    @property
    def acts_after_window(self) -> bool:
        return self.config.leave_enabled

    def on_window_start(self, state: State) -> None:
        if self.config.init_sparsity > 0:
            self.update_masks(self.config.init_sparsity)

    def on_optim_post_step(self, state: State) -> None:
        epoch = state.epoch_at(state.step + 1)  # the step that just finished counts
        frequency = self.config.update
        due = self.last_update is None or frequency is None or epoch - self.last_update >= frequency - 1e-9
        target = scheduled_sparsity(self.config, self.window.progress(epoch), epoch)
        if (due or self.window.progress(epoch) >= 1.0) and target != self.sparsity:
            self.update_masks(target)
            self.last_update = epoch
        else:
            self.apply()

    def on_window_end(self, state: State) -> None:
        if self.sparsity != self.config.final_sparsity:
            self.update_masks(self.config.final_sparsity)
        if not self.config.leave_enabled:
            self.masks.clear()

    def on_finalize(self, state: State) -> None:
        if self.sparsity != self.config.final_sparsity:
            logger.warning(
                "%s: training stopped at sparsity %.3f before the schedule reached %.3f (end=%s epochs); "
                "pruning to the final sparsity now, without training after it",
                type(self).__name__, self.sparsity, self.config.final_sparsity, self.config.end,
            )
            self.update_masks(self.config.final_sparsity)
        self.apply()
        self.masks.clear()

    @torch.no_grad()
    def update_masks(self, sparsity: float) -> None:
        for name, module in self.modules.items():
            # FSDP: the mask of the whole weight (its global share of zeros), applied shard by shard
            keep = magnitude_mask(linear_weight(whole(module.weight), module), sparsity, self.structure)
            self.masks[name] = like(linear_weight(keep, module), module.weight)  # back in the stored layout
        self.sparsity = sparsity
        self.apply()
        logger.debug("%s: sparsity %.4f", type(self).__name__, sparsity)

    @torch.no_grad()
    def apply(self) -> None:
        for name, mask in self.masks.items():
            self.modules[name].weight.mul_(mask)

    def measured_sparsity(self) -> dict[str, float]:
        """Zeros per pruned module, as a fraction of its weights."""
        return {n: sparsity_of(m) for n, m in self.modules.items()}
