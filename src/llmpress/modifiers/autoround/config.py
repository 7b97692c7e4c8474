"""What users write for ``AutoRoundModifier``: the scheme fields plus llm-compressor 0.14's
AutoRound fields, and a seed for the order samples are drawn in."""

from __future__ import annotations

from pydantic import model_validator

from llmpress.contract.modifier import OneShotFields
from llmpress.errors import RecipeError
from llmpress.modifiers.quantization.config import SchemeFields

__all__ = ["AutoRoundModifierConfig"]


class AutoRoundModifierConfig(SchemeFields, OneShotFields):
    """``iters``: tuning steps per block (0: no tuning, each weight rounded to nearest).
    ``batch_size``: samples per step. ``lr``: the signed step, falling linearly to zero (default
    ``1 / iters``; ``2 / iters`` for 3 bits or fewer and 1000 steps or more, as auto-round sets
    it). ``seed``: the order samples are drawn in (llmpress's; auto-round's is 42 as well).
    ``autocast`` (llmpress's): a float32 model's tuning passes run in bf16 where the device
    computes bf16 natively, as auto-round's ``amp`` does; the targets and the loss stay float32.
    ``disable_opt_rtn``: with ``iters: 0``, round to nearest over the min/max range rather than
    the searched one.

    Accepted so that llm-compressor's recipes run unchanged: ``enable_torch_compile`` (llmpress
    runs the tuning loop eagerly: on a CPU, compiling each block's loop costs more than it saves
    at these step counts) and ``device_ids`` (each block tunes where the pipeline calibrates it,
    one device; a list of several is refused)."""

    iters: int = 200
    batch_size: int = 8
    lr: float | None = None
    seed: int = 42
    autocast: bool = True
    disable_opt_rtn: bool = False
    enable_torch_compile: bool = True
    device_ids: str | None = None

    @model_validator(mode="after")
    def _check_autoround(self) -> AutoRoundModifierConfig:
        if self.iters < 0:
            raise RecipeError("AutoRoundModifier: iters must be 0 or more", got=self.iters, expected="e.g. 200 (0: round to nearest)")
        if self.batch_size < 1:
            raise RecipeError("AutoRoundModifier: batch_size must be positive", got=self.batch_size, expected="e.g. 8")
        if self.lr is not None and not self.lr > 0:
            raise RecipeError("AutoRoundModifier: lr must be positive", got=self.lr, expected="e.g. 0.005, or leave it out (1 / iters)")
        if self.device_ids is not None and len([d for d in self.device_ids.split(",") if d.strip()]) > 1:
            raise RecipeError(
                "AutoRoundModifier: llmpress tunes each block on one device",
                got=f"device_ids={self.device_ids!r}",
                expected="one device, or none (each block tunes where the pipeline calibrates it)",
                fix="leave device_ids out; run several ranks (torchrun) to share the samples",
            )
        return self

    @property
    def needs_calibration(self) -> bool:
        return True

    def step_size(self, bits: int) -> float:
        """The first step's size for weights of ``bits`` (the smallest among the schemes)."""
        if self.lr is not None:
            return self.lr
        return (2.0 if self.iters >= 1000 and bits <= 3 else 1.0) / max(self.iters, 1)
