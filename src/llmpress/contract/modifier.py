"""The modifier contract: what the session and the calibration pipeline read from a modifier.

A modifier is a plain behaviour class built from keyword arguments that its pydantic ``Config``
validates (``extra="forbid"``). Everything the session or a pipeline reads is declared here, with
a default a subclass overrides:

==============================  ===================================================================
``Config``                      the fields users write (compose ``SchemeFields``, ``WindowFields``)
``required_state()``            state fields needed at ``initialize`` (``"model"`` by default)
``window``                      a ``Window``: when the modifier acts in training (from ``start``/``end``)
``acts_after_window``           whether training events still reach it after its window closed
``calibration_targets()``       modules whose inputs it observes while calibrating (none by default)
``observe(name, x)``            one such input, handed over by the session
``scales_inputs(name)``         whether what it gathered from ``name``'s inputs can be rescaled
``scale_inputs(n, f)``          rescale it: those inputs are now ``x * f`` per channel (smoothing)
``step_note()``                 a short note for the pipeline's progress bar
``reduces_across_ranks``        whether it reduces what it gathers over torch.distributed ranks
``structure_from_any_tokens``   its forwards only find which modules feed which: no data needed
``events``                      derived: the events it has an ``on_<event>`` hook for
==============================  ===================================================================

Under torch.distributed each rank calibrates on its share of the samples, and the reduction is
the modifier's own: before it uses what it gathered (at ``modules_calibrated``,
``layer_calibrated``, ``calibration_end``) it sums, mins or maxes it over the ranks with
``llmpress.parallel.distributed`` (each helper is a no-op in one process), every rank in the
same order, and every rank ends with the same model. A modifier that gathers calibration data
without saying ``reduces_across_ranks = True`` is refused on several ranks.

Hooks are methods named ``on_<event>`` (``on_calibration_start(state)``,
``on_layer_calibrated(state, block)``, ...) plus the lifecycle hooks ``on_initialize``,
``on_finalize``, ``on_window_start`` and ``on_window_end``. A method named ``on_`` + anything
else is refused when the class is defined, so a misspelt hook fails at import instead of never
firing. See ``docs/adding-a-modifier.md``.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from llmpress.errors import RecipeError
from llmpress.registry import Registry

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CONFIG",
    "EVENTS",
    "MODIFIERS",
    "ONESHOT_EVENTS",
    "OneShotFields",
    "STATE_FIELDS",
    "TRAINING_EVENTS",
    "Modifier",
    "ModifierConfig",
    "State",
    "Window",
    "WindowFields",
]

MODIFIERS: Registry[type[Modifier]] = Registry("modifier", error=RecipeError)

TRAINING_EVENTS = ("batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end")
ONESHOT_EVENTS = ("calibration_start", "block_start", "modules_calibrated", "layer_calibrated", "layer_restored", "calibration_end")
EVENTS = TRAINING_EVENTS + ONESHOT_EVENTS
LIFECYCLE_HOOKS = ("initialize", "finalize", "window_start", "window_end")

# the state a session records, and what each field is
STATE_FIELDS: dict[str, str] = {
    "model": "the torch.nn.Module being compressed",
    "teacher": "a teacher model for distillation",
    "optimizer": "the torch optimizer of the training loop",
    "steps_per_epoch": "optimizer steps in one epoch (int)",
    "calibration_data": "calibration samples (token-id tensors or a dataloader)",
    "processor": "the tokenizer or processor of the model",
}

#: every modifier config: unknown fields are errors; tensors and modules may be values
CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


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
    """The config of a modifier without shared fields."""

    model_config = CONFIG


class WindowFields(BaseModel):
    """``start`` / ``end``: when a training modifier acts, in epochs (fractions allowed),
    ``start <= epoch < end``. ``end: null`` (or llm-compressor's ``-1``) means until the session
    ends."""

    model_config = CONFIG

    start: float = 0.0
    end: float | None = None

    @field_validator("end", mode="before")
    @classmethod
    def _minus_one_is_open(cls, value: Any) -> Any:
        return None if isinstance(value, (int, float, str)) and value in (-1, -1.0, "-1") else value

    @model_validator(mode="after")
    def _check_window(self) -> WindowFields:
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"needs 0 <= start < end, got start={self.start}, end={self.end}")
        return self


class OneShotFields(BaseModel):
    """``start`` / ``end`` as llm-compressor's recipes may give them to a one-shot modifier
    (every llm-compressor modifier has both fields): accepted when they mean "no training
    window" (unset, ``start`` 0 or -1, ``end`` -1), refused with an explanation otherwise."""

    model_config = CONFIG

    start: float | None = None
    end: float | None = None

    @model_validator(mode="after")
    def _one_shot_only(self) -> OneShotFields:
        if self.start not in (None, 0, -1) or self.end not in (None, -1):
            raise RecipeError(
                f"{type(self).__name__.removesuffix('Config')} runs one-shot: start / end (training epochs) do not apply to it",
                got=f"start={self.start}, end={self.end}",
                fix="remove start and end; to train after it, add a QuantizationModifier (QAT) in a training stage",
            )
        return self


class Window:
    """When a modifier acts in training, and where it stands: ``waiting`` until training reaches
    ``start``, ``open`` until an optimizer step passes ``end``, then ``closed``. The session
    moves it along; the modifier reads ``progress``."""

    def __init__(self, start: float = 0.0, end: float | None = None) -> None:
        self.start = start
        self.end = end
        self.state: Literal["waiting", "open", "closed"] = "waiting"

    @classmethod
    def of(cls, config: BaseModel) -> Window:
        """The window a config describes (always open when it has no ``start`` / ``end``)."""
        return cls(config.start, config.end) if isinstance(config, WindowFields) else cls()

    @property
    def is_timed(self) -> bool:
        """Whether it depends on the epoch (so the session must know ``steps_per_epoch``)."""
        return self.start > 0 or self.end is not None

    def contains(self, epoch: float) -> bool:
        return self.start <= epoch and (self.end is None or epoch < self.end)

    def has_passed(self, epoch: float) -> bool:
        return self.end is not None and epoch >= self.end

    def progress(self, epoch: float) -> float:
        """0.0 at ``start``, 1.0 at ``end`` (an open-ended window is 1.0 once started)."""
        if self.end is None:
            return 0.0 if epoch < self.start else 1.0
        return min(max((epoch - self.start) / (self.end - self.start), 0.0), 1.0)

    def open_if_reached(self, epoch: float) -> bool:
        """``waiting`` -> ``open`` when ``epoch`` is inside; True when it opened now."""
        if self.state == "waiting" and self.contains(epoch):
            self.state = "open"
            return True
        return False

    def close_if_passed(self, epoch: float) -> bool:
        """``open`` -> ``closed`` once ``epoch`` is past ``end``; True when it closed now."""
        if self.state == "open" and not self.contains(epoch):
            self.state = "closed"
            return True
        return False


class Modifier:
    """Base behaviour class. Subclasses set ``Config`` and define ``on_*`` hooks."""

    Config: ClassVar[type[BaseModel]] = ModifierConfig
    #: what it gathers from calibration data is reduced over torch.distributed ranks (see above)
    reduces_across_ranks: ClassVar[bool] = False
    #: the events this class has a hook for, derived when the class is defined
    events: ClassVar[frozenset[str]] = frozenset()
    #: its calibration forwards only find which modules feed which (SpinQuant's norms and their
    #: readers): given no calibration data, a one-shot run makes them on seeded random token ids
    structure_from_any_tokens: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hooks = {name[3:] for name in dir(cls) if name.startswith("on_") and callable(getattr(cls, name))}
        for hook in sorted(hooks - set(EVENTS) - set(LIFECYCLE_HOOKS)):
            close = difflib.get_close_matches(hook, [*EVENTS, *LIFECYCLE_HOOKS], n=1)
            raise TypeError(
                f"{cls.__name__}.on_{hook} is not a modifier hook"
                + (f": did you mean on_{close[0]}?" if close else "")
                + f" (events: {', '.join(EVENTS)}; lifecycle: {', '.join(LIFECYCLE_HOOKS)})"
            )
        cls.events = frozenset(hooks & set(EVENTS))

    def __init__(self, **kwargs: Any) -> None:
        try:
            self.config = self.Config(**kwargs)
        except ValidationError as exc:
            raise _recipe_error(type(self).__name__, self.Config, exc) from None
        except (TypeError, KeyError, IndexError, AttributeError) as exc:  # a field of the wrong shape, met in a validator
            raise RecipeError(f"{type(self).__name__} has a field of a shape it cannot read", got=f"{type(exc).__name__}: {exc}",
                              expected=f"the fields of {type(self).__name__} (docs/recipes.md)") from None
        self.window = Window.of(self.config)
        self.initialized = False
        self.finalized = False

    @classmethod
    def from_recipe(cls, fields: dict[str, Any]) -> list[Modifier]:
        """The modifiers a recipe entry of this class stands for: itself and its companions."""
        modifier = cls(**fields)
        return [modifier, *modifier.companions()]

    def companions(self) -> list[Modifier]:
        """Modifiers that run right after this one because of how it was written (AWQ given its
        own scheme brings the quantizer of that scheme): a recipe lists them after it."""
        return []

    # -- what the session and the pipelines read ------------------------------------------------
    def required_state(self) -> tuple[str, ...]:
        """State fields this modifier needs at ``initialize`` (the session adds
        ``steps_per_epoch`` for a window in epochs)."""
        return ("model",)

    @property
    def acts_after_window(self) -> bool:
        """Whether training events still reach the modifier after its window closed (pruning
        masks that stay enforced until finalize)."""
        return False

    def calibration_targets(self) -> dict[str, nn.Module]:
        """Modules whose inputs this modifier observes during calibration, by name. Read after
        ``initialize``; the session hands each input to ``observe``. None: it needs no
        calibration forward."""
        return {}

    def runs_blocks(self) -> bool:
        """Whether it runs blocks on their calibration inputs itself (KV-cache scales, at
        ``layer_calibrated``), so batches must flow even when it observes no module."""
        return False

    def observe(self, name: str, x: torch.Tensor) -> None:
        """The input ``x`` of target ``name`` in one calibration forward."""
        raise NotImplementedError(f"{type(self).__name__} has calibration targets but no observe()")

    def scales_inputs(self, name: str) -> bool:
        """Whether what it has gathered from target ``name``'s inputs can be rescaled per input
        channel after the fact (``scale_inputs``; a Hessian can, a per-tensor range cannot). Where
        every watcher of a block's balance layers can, SmoothQuant reads its ranges in the run
        that observes the block instead of a run of its own."""
        return False

    def scale_inputs(self, names: list[str], factor: torch.Tensor) -> None:
        """The inputs of targets ``names`` are ``x * factor`` per channel from now on (scales
        folded in after they were observed, before they are used): rescale what was gathered."""
        raise NotImplementedError(f"{type(self).__name__} cannot rescale what it observed")

    def step_note(self) -> str:
        """A short note on the modifier's last step (a layer's GPTQ losses, say), shown next to
        the pipeline's progress bar; empty when there is nothing to say."""
        return ""

    # -- lifecycle, called by the session ---------------------------------------------------
    def initialize(self, state: State) -> None:
        self.on_initialize(state)
        self.initialized = True

    def on_initialize(self, state: State) -> None:
        """Set up with the complete state (match modules, ...)."""

    def on_window_start(self, state: State) -> None:
        """The first training event inside the window (QAT switches fake quantization on)."""

    def on_window_end(self, state: State) -> None:
        """The first optimizer step that leaves the window (not called when ``end`` is open)."""

    def finalize(self, state: State) -> None:
        self.on_finalize(state)
        self.finalized = True

    def on_finalize(self, state: State) -> None:
        """Make the result permanent (apply masks, freeze quantization)."""

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``{ClassName: {non-default fields}}``: plain data for YAML, with the fields
        llm-compressor requires written even where they are llmpress's defaults (the config's
        ``llm_compressor_requires()``), so that it reads every recipe llmpress saves."""
        fields = self.config.model_dump(mode="json", exclude_defaults=True)
        required = getattr(self.config, "llm_compressor_requires", None)
        return {type(self).__name__: {**(required() if required else {}), **fields}}

    def clone(self) -> Modifier:
        return type(self)(**self.config.model_dump(exclude_defaults=True))

    def resume_note(self) -> Any:
        """Plain data (JSON) to keep with each finished layer for a resumed run (``take_resume_note``):
        what this modifier gathered from the layers so far that the saved result needs; None for nothing."""
        return None

    def take_resume_note(self, note: Any) -> None:
        """A resumed run: the note the interrupted one kept with its last finished layer."""

    def record_into(self, record: Modifier) -> None:
        """Finalized: give ``record`` (a clone the model keeps as its recipe, without this
        modifier's running state) what the saved recipe should say beyond the config (a
        smoothing modifier's mappings found)."""

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
