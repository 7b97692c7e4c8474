"""What a mixed-precision run chooses from, and toward what: the menu of schemes, the target
(average bits per weight, or the checkpoint's size), and what each scheme costs a module.

A menu entry is a scheme name (``W4A16``, ``W3A16_G32``, ``W2A16_ASYM``, ``NVFP4A16``...: the
presets and their spellings of ``quant/presets.py``), ``DENSE`` for "left as it is", or a
compressed-tensors scheme dict (``{name: ..., weights: {...}}``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, field_validator, model_validator

from llmpress.contract.modifier import CONFIG
from llmpress.errors import RecipeError, SchemeError
from llmpress.memory import parse_size
from llmpress.quant.groups import fitted_weight_group
from llmpress.quant.presets import preset_scheme
from llmpress.quant.scheme import QuantizationScheme, QuantizationStrategy

__all__ = ["DEFAULT_MENU", "DENSE", "MenuOption", "MixedPrecision", "default_menu", "menu_option", "weight_bits"]

DENSE = "DENSE"
#: the menu where the target is not known in bits before the model is seen (a size target)
DEFAULT_MENU = ("W3A16", "W3A16_G32", "W4A16", "W4A16_G32", "W8A16", DENSE)


def default_menu(average_bits: float | None) -> list[str]:
    """The menu when a recipe names none: int weight-only schemes in groups of 128 and 32 from
    the target's whole bits up to 4, then 8 bits and ``DENSE`` (4.25: ``W4A16, W4A16_G32, W8A16,
    DENSE``; 3.5: from ``W3A16``). Widths under the target buy bits for other modules with
    errors far from where the second-order estimate holds: at 4.25 bits, a menu from 3 bits
    chose worse than uniform W4A16 in groups of 64 on both models measured, one from 4 bits
    better (``bench/README.md``, "Mixed precision")."""
    if average_bits is None:
        return list(DEFAULT_MENU)
    low = min(max(int(average_bits), 2), 4)
    return [name for bits in range(low, 5) for name in (f"W{bits}A16", f"W{bits}A16_G32")] + ["W8A16", DENSE]


@dataclass(frozen=True)
class MenuOption:
    """One scheme a module may get: ``scheme`` None leaves it as it is."""

    name: str
    scheme: QuantizationScheme | None


def menu_option(entry: str | dict[str, Any]) -> MenuOption:
    """The option a menu entry names (see the module's docstring)."""
    if isinstance(entry, dict):
        fields = dict(entry)
        name = str(fields.pop("name", "")) or None
        scheme = QuantizationScheme(**fields)
        return MenuOption(name or _describe(scheme), scheme)
    text = str(entry).strip().upper()
    if text in (DENSE, "NONE"):
        return MenuOption(DENSE, None)
    try:
        return MenuOption(text, preset_scheme(text))
    except SchemeError as exc:
        raise RecipeError(f"mixed precision: {exc.what}", got=entry, expected=f"{exc.expected or 'a scheme name'}, or {DENSE}",
                          fix=exc.fix or "e.g. schemes: [W3A16, W4A16, W4A16_G32, W8A16]") from None


def _describe(scheme: QuantizationScheme) -> str:
    weights = scheme.weights
    if weights is None:
        return "INPUTS_ONLY"
    kind = "FP" if weights.is_float else "W"
    group = f"_G{weights.group_size}" if weights.is_grouped else f"_{str(weights.strategy).upper()}"
    return f"{kind}{weights.num_bits}{'' if weights.symmetric else '_ASYM'}{group}"


def weight_bits(scheme: QuantizationScheme | None, rows: int, columns: int, dtype: torch.dtype, divides: int | None = None) -> int:
    """The bits a ``rows`` x ``columns`` weight takes in the checkpoint under ``scheme`` (None:
    as it is, in ``dtype``): its values as compressed-tensors packs them, its scales (in the
    weight's dtype unless the scheme names theirs), zero points, global scale and group indices.
    ``divides``: the width its groups must divide where not its own (an expert's: its block's,
    ``quant.groups.shared_columns``)."""
    if scheme is None or scheme.weights is None:
        return rows * columns * _bits(dtype)
    args = fitted_weight_group(scheme, divides or columns).weights
    assert args is not None
    if args.is_float:
        values = rows * columns * args.num_bits
    else:  # int32 words, each row padded to whole words
        values = rows * math.ceil(columns * args.num_bits / 32) * 32
    if args.is_grouped:
        scales = rows * math.ceil(columns / args.group_size)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        scales = rows
    elif args.strategy == QuantizationStrategy.BLOCK:
        block_rows, block_columns = args.block_structure
        scales = math.ceil(rows / block_rows) * math.ceil(columns / block_columns)
    else:
        scales = 1
    scale_dtype = getattr(torch, args.scale_dtype.removeprefix("torch.")) if args.scale_dtype else dtype
    total = values + scales * _bits(scale_dtype)
    if not args.symmetric:
        total += scales * args.num_bits
    if args.has_global_scale:
        total += 32
    if args.actorder == "group":
        total += columns * 32
    return total


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


class MixedPrecision(BaseModel):
    """A mixed-precision choice: a scheme per module from ``schemes`` so that the targeted
    weights average ``average_bits`` (scales included), or the checkpoint is ``size`` bytes
    (``"60MB"``); each module's sensitivity is measured on ``samples`` calibration sequences;
    an MoE's experts take one scheme (``experts``)."""

    model_config = CONFIG

    average_bits: float | None = None
    size: int | str | None = None
    schemes: list[str | dict[str, Any]] | None = None  # None: ``default_menu`` of the target
    samples: int = 32
    #: the experts of an MoE: one scheme for all of them ("shared": transformers 5 reads one), or one
    #: per experts block ("per_block": vLLM and llmpress.load read it, transformers does not)
    experts: Literal["shared", "per_block"] = "shared"

    @field_validator("schemes", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> MixedPrecision:
        if (self.average_bits is None) == (self.size is None):
            raise RecipeError("mixed precision needs exactly one target: average_bits or size",
                              got=f"average_bits={self.average_bits}, size={self.size}",
                              expected="average_bits: 4.25 (bits per targeted weight, scales included) or size: 60MB",
                              fix="keep one of the two")
        if self.average_bits is not None and self.average_bits <= 0:
            raise RecipeError("mixed precision: average_bits must be positive", got=self.average_bits, expected="e.g. 4.25")
        if self.samples < 1:
            raise RecipeError("mixed precision: samples must be at least 1", got=self.samples, expected="e.g. 32")
        self.size_bytes()  # a size that does not read is refused now
        options = self.options()
        names = [o.name for o in options]
        if len(options) < 2 or len(set(names)) != len(names):
            raise RecipeError("mixed precision needs a menu of at least two different schemes", got=names,
                              expected="e.g. schemes: [W3A16, W4A16, W4A16_G32, W8A16]")
        inputs = {None if o.scheme is None or o.scheme.input_activations is None else o.scheme.input_activations.model_dump_json()
                  for o in options if o.scheme is not None}
        if len(inputs) > 1:
            raise RecipeError(
                "mixed precision chooses weight schemes: every scheme of its menu must quantize the inputs alike",
                got=names, expected="all weight-only (W4A16, W8A16, ...) or all with the same input activations",
                fix="keep the input activations of one kind in the menu, e.g. [W4A16, W4A16_G32, W8A16, DENSE]",
            )
        return self

    def options(self, average_bits: float | None = None) -> list[MenuOption]:
        """The menu: the recipe's, else the default for ``average_bits`` (by default the target's;
        a size target's once the model says what it means in bits)."""
        entries = self.schemes if self.schemes is not None else default_menu(average_bits or self.average_bits)
        return [menu_option(entry) for entry in entries]

    def size_bytes(self) -> int | None:
        if self.size is None:
            return None
        return parse_size(self.size, error=RecipeError)
