"""What users write for ``QuantizationModifier``, and the scheme fields every quantizing
modifier shares (``SchemeFields``: GPTQ composes them with its own fields)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, field_validator, model_validator

from llmpress.contract.modifier import CONFIG, WindowFields
from llmpress.errors import RecipeError, SchemeError
from llmpress.lifecycle.kv_cache import kv_cache_args
from llmpress.modifiers.mixed_precision.menu import MixedPrecision
from llmpress.quant.presets import is_preset, preset_scheme
from llmpress.quant.scheme import QuantizationArgs, QuantizationScheme

__all__ = ["QuantizationModifierConfig", "SchemeFields"]


class SchemeFields(BaseModel):
    """What to quantize and how: one of ``scheme`` (a preset name, a preset-to-targets map, or
    a scheme dict), ``config_groups`` (compressed-tensors groups, each with its own ``targets``)
    and ``mixed_precision`` (a scheme per module chosen from a menu to fit a size, on the
    calibration data: ``modifiers/mixed_precision``), with ``targets`` / ``ignore`` as
    llm-compressor reads them."""

    model_config = CONFIG

    targets: list[str] = ["Linear"]
    ignore: list[str] = []
    scheme: str | dict[str, Any] | None = None
    config_groups: dict[str, QuantizationScheme] | None = None
    mixed_precision: MixedPrecision | None = None
    kv_cache_scheme: dict[str, Any] | None = None
    #: llm-compressor 0.14's observer overrides: the observer of every scheme's weights / inputs
    #: (``observer: {weights: mse, input: minmax}`` alike); outputs are never quantized here
    weight_observer: str | None = None
    input_observer: str | None = None
    output_observer: str | None = None
    observer: dict[str, str] | None = None
    # Accepted so that recipes llm-compressor saved (0.14 writes both) run and load unchanged:
    # llmpress handles column counts that are not a multiple of the group size, and whether
    # calibration data is needed follows from the schemes, so neither changes anything here.
    bypass_divisibility_checks: bool = False
    requires_calibration_data: bool | None = None

    @field_validator("targets", "ignore", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _spelled_names_as_groups(cls, data: Any) -> Any:
        """A scheme name of llmpress's own (``W4A16_G32``: ``quant/presets.py``) becomes the
        config group it means, so that the recipe a run saves reads in llm-compressor too."""
        if not isinstance(data, dict) or "config_groups" in data:
            return data
        scheme, targets = data.get("scheme"), data.get("targets", ["Linear"])
        named = {scheme: targets} if isinstance(scheme, str) else scheme if isinstance(scheme, dict) else {}
        if not named or "weights" in named or "input_activations" in named or all(is_preset(str(n)) for n in named) \
                or not all(isinstance(n, str) for n in named):
            return data  # presets stay names
        try:
            groups = {f"group_{i}": preset_scheme(name, [aim] if isinstance(aim, str) else aim) for i, (name, aim) in enumerate(named.items())}
        except SchemeError:
            return data  # validated, and refused with the reason, as written
        return {**{k: v for k, v in data.items() if k != "scheme"}, "config_groups": groups}

    #: a modifier that may leave its scheme to an earlier modifier of its stage (GPTQ after a
    #: QuantizationModifier with the scheme, as llm-compressor's recipes write it)
    scheme_from_stage: ClassVar[bool] = False

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """As pydantic dumps it, with each config group's ``targets`` even where it is the
        default: compressed-tensors (so llm-compressor reading a saved recipe) requires them."""
        fields = super().model_dump(**kwargs)
        for name, scheme in (self.config_groups or {}).items():
            group = fields.get("config_groups", {}).get(name)
            if isinstance(group, dict):
                group.setdefault("targets", list(scheme.targets))
        return fields

    @property
    def has_scheme(self) -> bool:
        return self.scheme is not None or self.config_groups is not None or self.mixed_precision is not None

    @model_validator(mode="after")
    def _check_scheme(self) -> SchemeFields:
        if self.kv_cache_scheme is not None:
            kv_cache_args(self.kv_cache_scheme)  # refused now, with a clear error, when it cannot apply
        if not self.has_scheme and (self.scheme_from_stage or self.kv_cache_scheme is not None):
            return self  # GPTQ after the stage's scheme; or the KV cache alone
        given = [n for n in ("scheme", "config_groups", "mixed_precision") if getattr(self, n) is not None]
        if len(given) != 1:
            raise RecipeError(
                "QuantizationModifier needs exactly one of 'scheme', 'config_groups' and 'mixed_precision'",
                got=" and ".join(given) or "none of them",
                expected="scheme: W4A16 (or another preset), config_groups: {group_0: {...}}, or mixed_precision: {average_bits: 4.25}",
                fix="keep one of them",
            )
        self._observers()
        for scheme in self.resolved_schemes():  # validate presets and scheme dicts now, not at run time
            inputs = scheme.input_activations
            if inputs is not None and inputs.observes_range and inputs.uses_mse:
                raise RecipeError(
                    "llmpress observes a static input range as its minimum and maximum over the calibration data",
                    got=f"input observer {inputs.observer!r}", expected="minmax (or static_minmax)",
                    fix="leave the input observer out, or use minmax",
                )
        return self

    def _observers(self) -> dict[str, str]:
        """The observer overrides, by what they apply to (``weights``, ``input_activations``)."""
        single = {"weights": self.weight_observer, "input_activations": self.input_observer, "output_activations": self.output_observer}
        if self.observer is not None:
            if any(single.values()):
                raise RecipeError("observer overrides come either one by one or as the observer dict, not both",
                                  got=f"observer={self.observer} beside {[k for k, v in single.items() if v]}",
                                  fix="keep weight_observer / input_observer / output_observer, or observer: {weights: ..., input: ...}")
            unknown = set(self.observer) - {"weights", "input", "output"}
            if unknown:
                raise RecipeError("unknown keys in observer", got=sorted(unknown), expected="weights, input, output",
                                  fix="e.g. observer: {weights: mse, input: minmax}")
            single = {"weights": self.observer.get("weights"), "input_activations": self.observer.get("input"),
                      "output_activations": self.observer.get("output")}
        chosen = {field: name.lower() for field, name in single.items() if name}
        if "observer" in chosen.values():
            raise RecipeError("'observer' is not an observer's name", got="observer", expected="minmax, mse, static_minmax, ...")
        return chosen

    def with_observers(self, scheme: QuantizationScheme) -> QuantizationScheme:
        """``scheme`` with the recipe's observer overrides on its weights and inputs."""
        update = {}
        for field, name in self._observers().items():
            args = getattr(scheme, field)
            if args is not None and field != "output_activations":
                update[field] = QuantizationArgs(**{**args.model_dump(), "observer": name})  # validated: a known observer
        return scheme.model_copy(update=update) if update else scheme

    def resolved_schemes(self) -> list[QuantizationScheme]:
        """The schemes this config asks for, each with its own targets (with ``mixed_precision``:
        its menu, aimed at ``targets``; which module gets which is chosen at ``initialize``)."""
        return [self.with_observers(scheme) for scheme in self._schemes()]

    def _schemes(self) -> list[QuantizationScheme]:
        if not self.has_scheme:
            return []
        if self.mixed_precision is not None:
            return [o.scheme.model_copy(update={"targets": list(self.targets)})
                    for o in self.mixed_precision.options() if o.scheme is not None]
        if self.config_groups is not None:
            return list(self.config_groups.values())
        if isinstance(self.scheme, str):
            return [preset_scheme(self.scheme, self.targets)]
        assert self.scheme is not None
        if "weights" in self.scheme or "input_activations" in self.scheme:
            return [QuantizationScheme(**{"targets": self.targets, **self.scheme})]
        # {"W4A16": ["Linear"], "W8A8": ["re:.*down_proj"]}
        return [
            preset_scheme(name, [targets] if isinstance(targets, str) else targets)
            for name, targets in self.scheme.items()
        ]

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache_scheme is not None or self.mixed_precision is not None or any(
            s.input_activations is not None and s.input_activations.observes_range
            for s in self.resolved_schemes()
        )


class QuantizationModifierConfig(SchemeFields, WindowFields):
    """``QuantizationModifier``: the scheme fields, and ``start`` / ``end`` (epochs), which matter
    only in training: quantization-aware training runs from ``start``; the weights are frozen
    onto their grid at ``end`` or at ``finalize``."""

    @model_validator(mode="after")
    def _refuse_actorder(self) -> QuantizationModifierConfig:
        for scheme in self.resolved_schemes():
            if scheme.weights is not None and scheme.weights.actorder is not None:
                raise RecipeError(
                    "actorder is a GPTQ option: round-to-nearest quantization has no column order",
                    got=f"actorder={scheme.weights.actorder!r}",
                    expected="actorder: null with QuantizationModifier",
                    fix="remove actorder, or use GPTQModifier",
                )
        return self
