"""The modifier contract: a pydantic config (what users write) apart from a plain behaviour class.

A modifier is built from keyword arguments validated by its ``Config`` (``extra="forbid"``), says
which pieces of session state it needs (``required_state``), is initialized exactly once with the
complete state, acts on the events it declares, and is finalized once. Adding an algorithm is one
folder under ``modifiers/``, one ``@MODIFIERS.register`` and one test file.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    field_validator,
    model_validator,
)

from llmpress.errors import MissingStateError, RecipeError
from llmpress.registry import Registry

__all__ = ["MODIFIERS", "STATE_FIELDS", "Modifier", "ModifierConfig", "State", "WindowConfig"]

MODIFIERS: Registry[type[Modifier]] = Registry("modifier", error=RecipeError)

# the state a session records, and what each field is
STATE_FIELDS: dict[str, str] = {
    "model": "the torch.nn.Module being compressed",
    "teacher": "a teacher model for distillation",
    "optimizer": "the torch optimizer of the training loop",
    "steps_per_epoch": "optimizer steps in one epoch (int)",
    "calibration_data": "calibration samples (token-id tensors or a dataloader)",
    "processor": "the tokenizer or processor of the model",
}


class State(dict):
    """The session's recorded state: a dict limited to ``STATE_FIELDS``, read as attributes.

    ``step`` (optimizer steps completed) is kept by the session, not by users; ``epoch`` is
    derived from it and ``steps_per_epoch``."""

    step: int = 0

    def __getattr__(self, name: str) -> Any:
        if name in STATE_FIELDS:
            return self.get(name)
        raise AttributeError(name)

    @property
    def epoch(self) -> float:
        """Fractional epochs completed (0.0 while ``steps_per_epoch`` is unknown)."""
        return self.epoch_at(self.step)

    def epoch_at(self, step: int) -> float:
        steps = self.get("steps_per_epoch")
        return step / steps if steps else 0.0


class ModifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class WindowConfig(ModifierConfig):
    """When a training modifier acts, in epochs (fractions allowed): ``start <= epoch < end``.
    ``end: null`` (or llm-compressor's ``-1``) means until the session ends."""

    start: float = 0.0
    end: float | None = None

    @field_validator("end", mode="before")
    @classmethod
    def _minus_one_is_open(cls, value: Any) -> Any:
        return None if value is not None and float(value) == -1 else value

    @model_validator(mode="after")
    def _check_window(self) -> WindowConfig:
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"needs 0 <= start < end, got start={self.start}, end={self.end}")
        return self

    @property
    def has_window(self) -> bool:
        """Whether the window depends on the epoch (so the session must know steps_per_epoch)."""
        return self.start > 0 or self.end is not None


class Modifier:
    """Base behaviour class. Subclasses set ``Config`` and override the ``on_*`` hooks."""

    Config: ClassVar[type[BaseModel]] = ModifierConfig
    #: events this modifier acts on (see ``llmpress.session.EVENTS``)
    events: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **kwargs: Any) -> None:
        try:
            self.config = self.Config(**kwargs)
        except ValidationError as exc:
            raise _recipe_error(type(self).__name__, self.Config, exc) from None
        self.initialized = False
        self.finalized = False

    def __getattr__(self, name: str) -> Any:
        # fields read as attributes: modifier.scheme is modifier.config.scheme
        config = self.__dict__.get("config")
        if config is not None and name in type(config).model_fields:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # -- what it needs -------------------------------------------------------------------
    def required_state(self) -> tuple[str, ...]:
        """Names of the state fields this modifier needs at ``initialize``."""
        return ("model",)

    def needed_state(self) -> tuple[str, ...]:
        """``required_state`` plus ``steps_per_epoch`` when the modifier has an epoch window."""
        needs = self.required_state()
        if getattr(self.config, "has_window", False) and "steps_per_epoch" not in needs:
            needs += ("steps_per_epoch",)
        return needs

    def check_state(self, state: State) -> None:
        for field in self.needed_state():
            if state.get(field) is None:
                window = field == "steps_per_epoch" and "steps_per_epoch" not in self.required_state()
                raise MissingStateError(
                    f"{type(self).__name__} needs {field!r}"
                    + (" for its start/end window (epochs)" if window else "")
                    + f": call session.update_state({field}=...) before initialize()",
                    got=f"no {field}",
                    expected=STATE_FIELDS.get(field, field),
                    fix="one-shot runs have no epochs: remove start/end from the recipe there" if window else None,
                )

    # -- lifecycle, called by the session ---------------------------------------------------
    def initialize(self, state: State) -> None:
        self.check_state(state)
        self.on_initialize(state)
        self.initialized = True

    def on_initialize(self, state: State) -> None:
        """Set up with the complete state (attach hooks, match modules...)."""

    def on_event(self, event: str, state: State, **payload: Any) -> Any:
        return getattr(self, f"on_{event}")(state, **payload)

    # -- the training window ---------------------------------------------------------------
    @property
    def config_has_window(self) -> bool:
        """Whether the modifier takes ``start`` / ``end`` (it acts in training)."""
        return isinstance(self.config, WindowConfig)

    def active_at(self, epoch: float) -> bool:
        """Whether training events reach this modifier at ``epoch`` (always, without a window)."""
        if not self.config_has_window:
            return True
        start, end = self.config.start, self.config.end
        return start <= epoch and (end is None or epoch < end)

    def progress(self, epoch: float) -> float:
        """How far through its window the modifier is at ``epoch``: 0.0 at start, 1.0 at end."""
        start, end = self.config.start, self.config.end
        if end is None:
            return 0.0 if epoch < start else 1.0
        return min(max((epoch - start) / (end - start), 0.0), 1.0)

    @property
    def acts_after_window(self) -> bool:
        """Whether training events still reach the modifier after its window closed (pruning
        masks that stay enforced until finalize)."""
        return False

    def on_window_start(self, state: State) -> None:
        """The first training event inside the window (QAT switches fake quantization on)."""

    def on_window_end(self, state: State) -> None:
        """The first optimizer step that leaves the window (not called when ``end`` is open)."""

    def step_note(self) -> str:
        """A short note on the modifier's last step (a layer's GPTQ losses, say), shown next to
        the pipeline's progress bar; empty when there is nothing to say."""
        return ""

    def finalize(self, state: State) -> None:
        self.on_finalize(state)
        self.finalized = True

    def on_finalize(self, state: State) -> None:
        """Make the result permanent (apply masks, freeze quantization)."""

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{ClassName: {non-default fields}}``: plain data for YAML."""
        return {type(self).__name__: self.config.model_dump(mode="json", exclude_defaults=True)}

    def clone(self) -> Modifier:
        return type(self)(**self.config.model_dump(exclude_defaults=True))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.config == other.config  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump(exclude_defaults=True).items())
        return f"{type(self).__name__}({fields})"


def _nested_fields(config: type[BaseModel]) -> list[str]:
    """Field names of ``config`` and of the pydantic models its fields hold (schemes, args)."""
    names, todo, seen = [], [config], set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            names.append(name)
            todo += [t for t in _models_in(field.annotation)]
    return list(dict.fromkeys(names))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def _recipe_error(modifier: str, config: type[BaseModel], exc: ValidationError) -> RecipeError:
    known = list(config.model_fields)
    problems = []
    fix = None
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field {where!r}")
            candidates = known if len(err["loc"]) == 1 else _nested_fields(config)
            close = difflib.get_close_matches(str(err["loc"][-1]), candidates, n=1)
            fix = f"did you mean {close[0]!r}?" if close else None
        else:
            problems.append(f"{where}: {err['msg']}")
    nested = any(len(err["loc"]) > 1 for err in exc.errors())
    return RecipeError(
        f"{modifier}: {'; '.join(problems)}",
        got=f"{len(problems)} invalid field(s)",
        expected=f"fields among {', '.join(_nested_fields(config) if nested else known)}",
        fix=fix or f"correct the {modifier} arguments",
    )
