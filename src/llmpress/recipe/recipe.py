"""Recipes: stages of modifier groups, in llm-compressor's YAML grammar.

::

    quant_stage:                 # a stage: a key ending in _stage
      quant_modifiers:           # a group: a key ending in _modifiers
        QuantizationModifier:    # a registered modifier and its fields
          scheme: W4A16

A recipe comes from a modifier or a list of them, a preset name (``"W4A16"``), a YAML or JSON
file or string, or a dict; it always serializes to plain YAML that ``yaml.safe_load`` reads back
to an equal recipe.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmpress.contract.modifier import MODIFIERS, Modifier
from llmpress.errors import RecipeError
from llmpress.modifiers.quantization import QuantizationModifier
from llmpress.quant.presets import NAMES_HINT
from llmpress.recipe.yaml_loader import MAX_RECIPE_BYTES, load_recipe_yaml

__all__ = ["Recipe", "RecipeStage"]

logger = logging.getLogger(__name__)

DEFAULT_STAGE = "default_stage"
DEFAULT_GROUP = "default_modifiers"


class _RecipeDumper(yaml.SafeDumper):
    """Lists of plain values on one line (``ignore: [lm_head]``, a SmoothQuant mapping's
    ``[[q_proj, k_proj, v_proj], input_layernorm]``), as recipes are written by hand."""


def _represent_list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    flat = all(isinstance(i, (str, int, float, bool)) or (isinstance(i, list) and all(isinstance(j, str) for j in i)) for i in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flat and bool(items))


_RecipeDumper.add_representer(list, _represent_list)

#: a string that can only be a scheme's name (a recipe in YAML has a colon, a file's path a dot or a slash)
_ONE_NAME = re.compile(r"[A-Za-z0-9_]+")


@dataclass
class RecipeStage:
    name: str
    groups: dict[str, list[Modifier]] = field(default_factory=dict)
    run_type: str | None = None

    @property
    def modifiers(self) -> list[Modifier]:
        return [m for group in self.groups.values() for m in group]

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.run_type:
            body["run_type"] = self.run_type
        for group, modifiers in self.groups.items():
            entries = [m.to_dict() for m in modifiers]
            names = [next(iter(e)) for e in entries]
            if len(set(names)) == len(names):
                body[group] = {k: v for e in entries for k, v in e.items()}
            else:  # the same modifier twice in a group: the list form keeps both
                body[group] = entries
        return body


class Recipe:
    def __init__(self, stages: list[RecipeStage] | None = None) -> None:
        self.stages = list(stages or [])

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_any(cls, source: Any) -> Recipe:
        """Build from whatever a user passed as a recipe."""
        if isinstance(source, Recipe):
            return source
        if isinstance(source, Modifier):
            return cls.from_modifiers([source])
        if isinstance(source, (list, tuple)) and all(isinstance(m, Modifier) for m in source):
            return cls.from_modifiers(list(source))
        if isinstance(source, dict):
            return cls.from_dict(source)
        if isinstance(source, Path) or (isinstance(source, str) and _looks_like_path(source)):
            return cls.from_file(source)
        if isinstance(source, str):
            if _ONE_NAME.fullmatch(source.strip()):  # a scheme name, or an error that says why it is not one
                try:
                    return cls.from_preset(source)
                except RecipeError as exc:
                    raise RecipeError(f"{source.strip()!r} is not a recipe: {exc.what}", got=exc.got,
                                      expected=f"a scheme name ({NAMES_HINT}) or a recipe file's path", fix=exc.fix) from None
            return cls.from_yaml(source)
        raise RecipeError(
            "cannot build a recipe from this object",
            got=type(source).__name__,
            expected="a Recipe, a modifier or list of modifiers, a preset name, a YAML/JSON file or string, or a dict",
        )

    @classmethod
    def from_modifiers(cls, modifiers: list[Modifier], stage: str = DEFAULT_STAGE) -> Recipe:
        expanded = [c for m in modifiers for c in (m, *m.companions())]  # AWQModifier(scheme=...) brings its quantizer
        return cls([_schemes_from_stage(RecipeStage(stage, {DEFAULT_GROUP: expanded}))])

    @classmethod
    def from_preset(cls, name: str, ignore: list[str] | None = None) -> Recipe:
        """The RTN recipe for a scheme name (a preset, or ``W4A16_G32``...: ``quant/presets.py``),
        leaving ``lm_head`` in full precision."""
        modifier = QuantizationModifier(targets=["Linear"], ignore=ignore or ["lm_head"], scheme=name.upper())
        return cls([RecipeStage("quant_stage", {"quant_modifiers": [modifier]})])

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        path = Path(path)
        try:  # any readable file: no suffix needed, a pipe (/dev/fd/N) too
            with open(path, encoding="utf-8") as handle:
                text = handle.read(MAX_RECIPE_BYTES + 1)  # never a whole large file: the bound refuses it
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(
                "cannot read the recipe file",
                got=f"{path}: {exc.strerror or exc}" if isinstance(exc, OSError) else f"{path}: not UTF-8 text",
                expected="a readable YAML or JSON recipe file, or a preset name",
                fix=f"check the path, or use a preset: {NAMES_HINT}",
            ) from None
        return cls.from_yaml(text, origin=str(path))

    @classmethod
    def from_yaml(cls, text: str, origin: str = "recipe") -> Recipe:
        data = load_recipe_yaml(text, origin)  # JSON is YAML too; bounded, no repeated keys
        if not isinstance(data, dict):
            hint = f"; '{text.strip()}' is not a preset either" if isinstance(data, str) else ""
            raise RecipeError(
                f"{origin} must be a mapping of stages{hint}",
                got=type(data).__name__,
                expected=f"'<name>_stage: {{<group>_modifiers: {{XModifier: {{...}}}}}}' or a preset ({NAMES_HINT})",
            )
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        stages: list[RecipeStage] = []
        loose: dict[str, Any] = {}
        try:
            _check_patterns(data)
        except RecursionError:
            raise RecipeError("the recipe nests too deeply", expected="a recipe a few levels deep") from None
        for key, value in _named(data, "the recipe").items():
            if key == "version":
                continue
            if key.endswith("_stage"):
                stages.append(_parse_stage(key, value))
            elif key.endswith("_modifiers") or key in MODIFIERS or key.endswith("Modifier"):
                loose[key] = value
            else:
                raise RecipeError(
                    f"unknown top-level recipe key {key!r}",
                    got=key,
                    expected="keys ending in _stage, _modifiers, or a modifier name",
                    fix=f"rename it to '{key}_stage' if it is a stage",
                )
        if loose:
            stages.insert(0, _parse_stage(DEFAULT_STAGE, loose))
        return cls(stages)

    # -- reading -------------------------------------------------------------------------
    @property
    def modifiers(self) -> list[Modifier]:
        return [m for stage in self.stages for m in stage.modifiers]

    def with_modifiers(self, modifiers: list[Modifier]) -> Recipe:
        """This recipe's stages and groups holding ``modifiers`` instead, in ``self.modifiers``
        order (a session's records of its modifiers, which say what they found: a smoothing
        modifier's mappings)."""
        if len(modifiers) != len(self.modifiers):
            raise ValueError(f"{len(modifiers)} modifiers for a recipe of {len(self.modifiers)}")
        given = iter(modifiers)
        return Recipe([RecipeStage(stage.name, {group: [next(given) for _ in members] for group, members in stage.groups.items()},
                                   stage.run_type) for stage in self.stages])

    def to_dict(self) -> dict[str, Any]:
        return {stage.name: stage.to_dict() for stage in self.stages}

    def to_yaml(self) -> str:
        return yaml.dump(self.to_dict(), Dumper=_RecipeDumper, sort_keys=False)

    def __add__(self, other: Recipe) -> Recipe:
        """Stages of both, renaming the second recipe's stages when names clash."""
        names = {s.name for s in self.stages}
        stages = list(self.stages)
        for stage in other.stages:
            name, i = stage.name, 1
            while name in names:
                name, i = f"{stage.name.removesuffix('_stage')}_{i}_stage", i + 1
            names.add(name)
            stages.append(RecipeStage(name, stage.groups, stage.run_type))
        return Recipe(stages)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recipe) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Recipe({json.dumps(self.to_dict())})"


def _parse_stage(name: str, body: Any) -> RecipeStage:
    if not isinstance(body, dict):
        raise RecipeError(f"stage {name!r} must be a mapping of modifier groups", got=type(body).__name__)
    stage = RecipeStage(name)
    loose: list[Modifier] = []
    for key, value in _named(body, f"stage {name!r}").items():
        if key == "run_type":
            stage.run_type = str(value)
        elif key.endswith("_modifiers"):
            stage.groups[key] = _parse_group(f"{name}.{key}", value)
        else:
            loose.extend(_parse_group(name, {key: value}))
    if loose:
        stage.groups = {DEFAULT_GROUP: loose, **stage.groups}
    if not stage.modifiers:
        raise RecipeError(f"stage {name!r} has no modifiers: it would save an unchanged copy of the model",
                          got=repr(body)[:120], expected="<group>_modifiers: {XModifier: {...}}")
    return _schemes_from_stage(stage)


_SCHEME_FIELDS = ("scheme", "config_groups", "mixed_precision", "targets", "ignore", "kv_cache_scheme")


def _schemes_from_stage(stage: RecipeStage) -> RecipeStage:
    """llm-compressor's grammar: a modifier without a scheme of its own (GPTQ with only
    ``block_size``) quantizes, with its algorithm, what the stage's earlier QuantizationModifier
    describes. The two become one modifier: the scheme modifier's fields in the algorithm's."""
    donors: list[tuple[str, Modifier]] = []  # the stage's QuantizationModifiers so far, not yet taken
    for group, modifiers in list(stage.groups.items()):
        for modifier in list(modifiers):
            config = modifier.config
            if isinstance(modifier, QuantizationModifier) and modifier.gives_scheme_to_stage:
                donors.append((group, modifier))
            elif getattr(type(config), "scheme_from_stage", False) and not config.has_scheme:
                if not donors:
                    raise RecipeError(
                        f"stage {stage.name!r}: {type(modifier).__name__} has no scheme, and no QuantizationModifier before it "
                        "in the stage gives one",
                        got=f"{type(modifier).__name__}: {config.model_dump(exclude_defaults=True)}",
                        expected="scheme: W4A16 (or config_groups) on it, or a QuantizationModifier with the scheme before it",
                    )
                donor_group, donor_modifier = donors.pop()
                fields = config.model_dump(exclude_defaults=True)
                fields.update({k: v for k, v in donor_modifier.config.model_dump(exclude_defaults=True).items() if k in _SCHEME_FIELDS})
                stage.groups[donor_group].remove(donor_modifier)
                stage.groups[group][stage.groups[group].index(modifier)] = type(modifier)(**fields)
                logger.info("stage %s: %s quantizes what the QuantizationModifier before it describes", stage.name, type(modifier).__name__)
    stage.groups = {g: m for g, m in stage.groups.items() if m}
    return stage


def _parse_group(where: str, body: Any) -> list[Modifier]:
    if isinstance(body, list):  # [{XModifier: {...}}, {YModifier: {...}}]
        for entry in body:
            if not isinstance(entry, dict):
                raise RecipeError(
                    f"each entry of the list {where} must map a modifier name to its fields",
                    got=repr(entry),
                    expected="- XModifier: {field: value}",
                )
        items = [item for entry in body for item in _named(entry, where).items()]
    elif isinstance(body, dict):
        items = list(_named(body, where).items())
    else:
        raise RecipeError(f"{where} must map modifier names to their fields", got=type(body).__name__)
    modifiers = []
    for modifier_name, args in items:
        cls = MODIFIERS.get(modifier_name)  # unknown names list the known ones
        if args is not None and not isinstance(args, dict):
            raise RecipeError(f"{where}.{modifier_name} must be a mapping of fields", got=repr(args))
        modifiers.extend(cls.from_recipe(_named(args or {}, f"{where}.{modifier_name}")))
    return modifiers


def _check_patterns(value: Any) -> None:
    """Every ``re:`` pattern of the recipe compiles (a bad one is refused before any work)."""
    if isinstance(value, str) and value.startswith("re:"):
        try:
            re.compile(value[3:])
        except re.error as exc:
            raise RecipeError(f"{value!r} is not a valid regular expression", got=str(exc), fix="fix the pattern after 're:'") from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_patterns(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_patterns(item)


def _named(mapping: dict, where: str) -> dict:
    """``mapping``, whose keys must be names (YAML lets a key be a number, a list or nothing)."""
    odd = [key for key in mapping if not isinstance(key, str)]
    if odd:
        raise RecipeError(f"the keys of {where} must be names", got=repr(odd[0]), expected="a text key, e.g. quant_stage")
    return mapping


def _looks_like_path(text: str) -> bool:
    if "\n" in text or text.lstrip().startswith("{"):
        return False
    if text.endswith((".yaml", ".yml", ".json")):
        return True
    try:
        return Path(text).exists() and not Path(text).is_dir()  # a file, a pipe, /dev/fd/N
    except OSError:  # too long or otherwise impossible as a file name: not a path
        return False
