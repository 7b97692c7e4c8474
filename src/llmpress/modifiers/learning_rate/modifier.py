"""``LearningRateModifier``: the recipe sets the optimizer's learning rate on a schedule.

Before every optimizer step inside the window, each parameter group's ``lr`` is set from the
progress through the window (epochs, fractions allowed)::

    LearningRateModifier:
      lr_func: cosine        # constant | linear | cosine | exponential
      init_lr: 1.0e-4
      final_lr: 1.0e-6
      start: 0
      end: 2

When the window closes the final rate stays (set before every later step too). Inside a Trainer
it overrides the Trainer's own scheduler (it writes ``lr`` just before each step); the Trainer's
logs still show its scheduler's rate, so use ``lr_scheduler_type="constant"`` there.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import model_validator

from llmpress.contract.modifier import MODIFIERS, Modifier, State, WindowFields

__all__ = ["LearningRateModifier", "scheduled_lr"]


def scheduled_lr(func: str, progress: float, init_lr: float, final_lr: float) -> float:
    """The rate at ``progress`` in [0, 1] through the window."""
    if func == "constant":
        return init_lr
    if func == "linear":
        return init_lr + (final_lr - init_lr) * progress
    if func == "cosine":
        return final_lr + 0.5 * (init_lr - final_lr) * (1 + math.cos(math.pi * progress))
    return init_lr * (final_lr / init_lr) ** progress  # exponential


class LearningRateConfig(WindowFields):
    lr_func: Literal["constant", "linear", "cosine", "exponential"] = "linear"
    init_lr: float
    final_lr: float | None = None

    @model_validator(mode="after")
    def _check_schedule(self) -> LearningRateConfig:
        if self.init_lr <= 0 or (self.final_lr is not None and self.final_lr < 0):
            raise ValueError(f"learning rates must be positive, got init_lr={self.init_lr}, final_lr={self.final_lr}")
        if self.lr_func != "constant" and (self.final_lr is None or self.end is None):
            raise ValueError(f"lr_func {self.lr_func!r} needs final_lr and end (the schedule runs from start to end)")
        if self.lr_func == "exponential" and not self.final_lr:
            raise ValueError("lr_func 'exponential' needs final_lr > 0")
        return self


@MODIFIERS.register("LearningRateModifier")
class LearningRateModifier(Modifier):
    Config = LearningRateConfig

    def required_state(self) -> tuple[str, ...]:
        return ("optimizer",)

    def on_initialize(self, state: State) -> None:
        self.optimizer = state.optimizer
        self.lr: float | None = None

    @property
    def acts_after_window(self) -> bool:
        return True  # the final rate stays, over any scheduler of the loop's own

    def on_window_start(self, state: State) -> None:
        self.set_lr(self.rate(state.epoch))

    def on_optim_pre_step(self, state: State) -> None:
        self.set_lr(self.rate(state.epoch))

    def on_window_end(self, state: State) -> None:
        self.set_lr(self.rate(state.epoch))

    def rate(self, epoch: float) -> float:
        c = self.config
        final = c.final_lr if c.final_lr is not None else c.init_lr
        return scheduled_lr(c.lr_func, self.window.progress(epoch), c.init_lr, final)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.lr = lr
