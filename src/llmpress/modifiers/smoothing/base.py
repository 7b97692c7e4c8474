"""What SmoothQuant and AWQ share: the mappings of each block (given or found), logged when they
change, and a clear error for a model without blocks."""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import field_validator

from llmpress.contract.modifier import Modifier, ModifierConfig, OneShotFields, State
from llmpress.errors import UnsupportedModelError
from llmpress.modifiers.smoothing.mappings import Mapping, MappingMemo, find_mappings, resolve_mappings

if TYPE_CHECKING:
    from llmpress.contract.block import CalibrationBlock

__all__ = ["SmoothingConfig", "SmoothingModifier"]

logger = logging.getLogger(__name__)


class SmoothingConfig(ModifierConfig, OneShotFields):
    #: ``[[balance patterns], smooth pattern]`` (SmoothQuant's form) or ``{smooth_layer, balance_layers}``
    #: (AWQ's); found from each block when absent
    mappings: list[tuple[list[str], str]] | None = None
    ignore: list[str] = []
    # accepted so that recipes saved by llm-compressor run unchanged (it writes the field out)
    requires_calibration_data: Literal[True] = True

    @field_validator("mappings", mode="before")
    @classmethod
    def _awq_form(cls, value):
        if not isinstance(value, list):
            return value
        forms = []
        for item in value:
            if isinstance(item, dict):
                if "balance_layers" not in item or "smooth_layer" not in item:
                    raise ValueError(f"a mapping needs balance_layers and smooth_layer, got {sorted(map(str, item))}")
                item = (item["balance_layers"], item["smooth_layer"])
            forms.append(item)
        return forms

    @field_validator("ignore", mode="before")
    @classmethod
    def _none_is_empty(cls, value):
        return [] if value is None else value


def as_patterns(mapping: Mapping, prefix: str) -> tuple[list[str], str]:
    r"""``mapping`` as ``([balance patterns], smooth pattern)`` for every block: the names inside
    the block, an expert's number as any number (``re:.*\.mlp\.experts\.\d+\.gate_proj$``). Each
    smooth layer's balance layers are resolved under its closest ancestor, so one pattern pair
    names each expert's own ``up_proj -> down_proj``."""
    def pattern(name: str) -> str:
        inner = re.escape(name.removeprefix(prefix))
        return "re:.*\\." + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", inner) + "$"

    balance = []
    for name in mapping.balance_names:
        if pattern(name) not in balance:
            balance.append(pattern(name))
    return balance, pattern(mapping.smooth_name)


class SmoothingModifier(Modifier):
    """Scales folded into each block at ``block_start``; subclasses say how (``smooth``)."""

    reduces_across_ranks = True  # statistics and search errors summed over the ranks

    #: found mappings include Linear -> Linear ones (v_proj -> o_proj, up_proj -> down_proj)
    linear_sources: ClassVar[bool] = False

    def required_state(self) -> tuple[str, ...]:
        return ("model", "calibration_data")

    def on_initialize(self, state: State) -> None:
        self.prefix_of = {m: f"{n}." for n, m in state.model.named_modules()}
        self.smoothed = 0  # mappings applied
        self._told_inner_part = False
        self.blocks = 0
        self._last_found = ""
        self.memo = MappingMemo()  # repeated blocks: found and checked once
        self.found: list[tuple[list[str], str]] = []  # the mappings applied, as recipe patterns (``to_dict``)

    def on_block_start(self, state: State, block: CalibrationBlock) -> None:
        self.blocks += 1
        prefix = self.prefix_of.get(block.module, "")
        if self.config.mappings:
            mappings, skipped = resolve_mappings(block, prefix, self.config.mappings, self.config.ignore, self.memo)
        else:
            mappings, skipped = find_mappings(block, prefix, self.config.ignore, self.linear_sources, self.memo)
        mappings = self.usable(mappings, skipped)
        described = Counter(m.describe() for m in mappings)  # an MoE's experts: "up_proj -> down_proj (x4)"
        found = "; ".join(text + (f" (x{count})" if count > 1 else "") for text, count in described.items())
        if found != self._last_found or skipped:
            logger.info("%s, block %d: %s%s", type(self).__name__, block.index, found or "no mapping",
                        f" (skipped: {'; '.join(skipped)})" if skipped else "")
            self._last_found = found
        if mappings:
            self.smooth(block, mappings)
            self.smoothed += len(mappings)
            self._remember(as_patterns(m, prefix) for m in mappings)
            inner = [m for m in mappings if m.rows and m.rows[1] != m.smooth.weight.shape[0]]
            if inner and not self._told_inner_part:
                self._told_inner_part = True
                logger.warning("%s: %s uses rows of a fused Linear that are not its last; the saved recipe names the "
                               "whole layer, which llmpress resolves to the same rows but llm-compressor to the last "
                               "ones", type(self).__name__, inner[0].describe())

    def _remember(self, patterns) -> None:
        """Add ``([balance patterns], smooth pattern)`` pairs to ``found``, each once."""
        for balance, smooth in patterns:
            if (list(balance), smooth) not in self.found:
                self.found.append((list(balance), smooth))

    def to_dict(self) -> dict[str, Any]:
        """The recipe entry, its mappings in this modifier's syntax; where they were found, not
        given, the ones applied, as patterns: the saved recipe says what was smoothed
        (``llmpress inspect``), and running it again applies the same mappings."""
        entry = super().to_dict()
        mappings = self.config.mappings or getattr(self, "found", None)
        if mappings:
            entry[type(self).__name__]["mappings"] = self.recipe_mappings([(list(b), s) for b, s in mappings])
        return entry

    def record_into(self, record: Modifier) -> None:
        record.found = list(getattr(self, "found", []))

    def resume_note(self) -> Any:
        return list(self.found)  # the restored layers' mappings, for the recipe (JSON writes the pairs as lists)

    def take_resume_note(self, note: Any) -> None:
        self._remember(note)

    def recipe_mappings(self, found: list[tuple[list[str], str]]) -> list:
        """``found`` in this modifier's recipe syntax: SmoothQuant's ``[[balance], smooth]``."""
        return [[balance, smooth] for balance, smooth in found]

    def on_layer_restored(self, state: State, block: CalibrationBlock) -> None:
        """A resumed run put ``block`` back with its scales folded in: nothing left to do here."""
        self.blocks += 1

    def usable(self, mappings: list[Mapping], skipped: list[str]) -> list[Mapping]:
        """The mappings this algorithm can use (the rest added to ``skipped``, with why)."""
        return mappings

    def smooth(self, block: CalibrationBlock, mappings: list[Mapping]) -> None:
        raise NotImplementedError

    def on_calibration_end(self, state: State) -> None:
        if self.blocks == 0:
            raise UnsupportedModelError(
                f"{type(self).__name__} smooths a model block by block and was given no block",
                got=f"{type(state.model).__name__}, calibrated without blocks (the 'basic' pipeline, or no repeated layers found)",
                expected="the layerwise pipeline (the default) on a model with a list of repeated layers",
            )
        if not self.smoothed:
            logger.warning("%s: no mapping found or kept in any block: nothing was smoothed", type(self).__name__)
        else:
            logger.info("%s: %d mappings smoothed", type(self).__name__, self.smoothed)
