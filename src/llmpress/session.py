"""The session: applies a recipe's modifiers to a model with a clear lifecycle.

1. ``Session(recipe)``; ``with session:`` makes it the active one (context-local).
2. ``update_state(model=..., optimizer=..., ...)`` any number of times: it only records.
3. ``initialize(**overrides)`` once: every modifier checks what it needs and sets up.
4. Events: training (``batch_start``, ``loss_calculated``, ``optim_pre_step``, ``optim_post_step``,
   ``batch_end``) and one-shot (``calibration_start``, ``layer_calibrated``, ``calibration_end``).
5. ``finalize()`` makes the result permanent and ends the session.

Out-of-order calls raise ``SessionError``; nothing is ever a silent no-op.
"""

from __future__ import annotations

import contextvars
import logging
from enum import Enum
from typing import Any

from llmpress.checkpoint.save import route_save_pretrained
from llmpress.errors import SessionError
from llmpress.modifiers.base import STATE_FIELDS, Modifier, State
from llmpress.recipe import APPLIED_RECIPE_ATTR, Recipe

__all__ = ["Session", "active_session", "EVENTS"]

logger = logging.getLogger(__name__)

TRAINING_EVENTS = ("batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end")
ONESHOT_EVENTS = ("calibration_start", "layer_calibrated", "calibration_end")
EVENTS = TRAINING_EVENTS + ONESHOT_EVENTS

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("llmpress_session", default=None)


class Status(str, Enum):
    CREATED = "created"
    INITIALIZED = "initialized"
    FINALIZED = "finalized"
    FAILED = "failed"  # initialize() raised after modifiers began to change the model


def active_session() -> Session:
    """The session made active by the innermost ``with session:`` block of this context."""
    session = _ACTIVE.get()
    if session is None:
        raise SessionError(
            "no session is active",
            fix="create one with session = llmpress.Session(recipe) and enter it with 'with session:'",
        )
    return session


class Session:
    def __init__(self, recipe: Any = None) -> None:
        self.recipe = Recipe.from_any(recipe) if recipe is not None else Recipe()
        self.modifiers: list[Modifier] = [m.clone() for m in self.recipe.modifiers]
        self.state = State()
        self.status = Status.CREATED
        self.step = 0
        self._tokens: list[contextvars.Token] = []

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> Session:
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._tokens.pop())

    # -- lifecycle ---------------------------------------------------------------------------
    def update_state(self, **state: Any) -> Session:
        """Record state for the modifiers; they see it at ``initialize()``."""
        self._require(Status.CREATED, "update_state")
        self._check_fields(state, "update_state")
        self.state.update({k: v for k, v in state.items() if v is not None})
        return self

    def initialize(self, **overrides: Any) -> Session:
        """Initialize every modifier exactly once with the recorded state (overrides win)."""
        self._require(Status.CREATED, "initialize")
        self._check_fields(overrides, "initialize")
        self.state.update({k: v for k, v in overrides.items() if v is not None})
        for modifier in self.modifiers:  # every need is checked before any modifier acts
            modifier.check_state(self.state)
        try:
            for modifier in self.modifiers:
                modifier.initialize(self.state)
        except BaseException:
            self.status = Status.FAILED
            raise
        self.status = Status.INITIALIZED
        return self

    def finalize(self) -> Session:
        """Make every modifier's result permanent and end the session."""
        self._require(Status.INITIALIZED, "finalize")
        for modifier in self.modifiers:
            modifier.finalize(self.state)
        model = self.state.get("model")
        if model is not None and self.recipe.stages:
            applied = getattr(model, APPLIED_RECIPE_ATTR, None) or Recipe()
            setattr(model, APPLIED_RECIPE_ATTR, applied + self.recipe)
            route_save_pretrained(model)
        self.status = Status.FINALIZED
        return self

    # -- events ------------------------------------------------------------------------------
    def event(self, name: str, **payload: Any) -> Any:
        """Send an event to the modifiers that act on it. ``loss_calculated`` returns the loss
        after every modifier had its say; other events return None."""
        if name not in EVENTS:
            raise SessionError(f"unknown event {name!r}", expected=f"one of {', '.join(EVENTS)}")
        self._require(Status.INITIALIZED, f"event {name!r}")
        if name == "batch_start":
            self.step += 1
        for modifier in self.modifiers:
            if name not in modifier.events:
                continue
            result = modifier.on_event(name, self.state, **payload)
            if name == "loss_calculated" and result is not None:
                payload["loss"] = result
        return payload.get("loss") if name == "loss_calculated" else None

    def batch_start(self) -> None:
        self.event("batch_start")

    def loss_calculated(self, loss: Any) -> Any:
        return self.event("loss_calculated", loss=loss)

    def optim_pre_step(self) -> None:
        self.event("optim_pre_step")

    def optim_post_step(self) -> None:
        self.event("optim_post_step")

    def batch_end(self) -> None:
        self.event("batch_end")

    def calibration_start(self) -> None:
        self.event("calibration_start")

    def layer_calibrated(self, index: int, layer: Any) -> None:
        self.event("layer_calibrated", index=index, layer=layer)

    def calibration_end(self) -> None:
        self.event("calibration_end")

    @property
    def needs_calibration_forward(self) -> bool:
        """Whether any modifier needs calibration batches to flow through the model."""
        return any(getattr(m, "needs_calibration_forward", False) for m in self.modifiers)

    # -- checks ------------------------------------------------------------------------------
    def _require(self, wanted: Status, call: str) -> None:
        if self.status == wanted:
            return
        if self.status == Status.FAILED:
            raise SessionError(
                f"{call} called on a session whose initialize() failed",
                got="a failed session (its modifiers may have changed the model part way)",
                fix="reload the model and create a new llmpress.Session(recipe)",
            )
        if self.status == Status.FINALIZED:
            raise SessionError(
                f"{call} called after finalize(): the session has ended",
                got="a finalized session",
                fix="create a new llmpress.Session(recipe) for more work",
            )
        if self.status == Status.INITIALIZED:
            raise SessionError(
                f"{call} called on a session that is already initialized",
                got="an initialized session",
                expected="update_state() and initialize() only before the one initialize()",
                fix="supply all state before initialize() (update_state(...) or initialize(**overrides)); "
                "to start over, create a new llmpress.Session(recipe)",
            )
        raise SessionError(
            f"{call} called before initialize()",
            got="a session that is not initialized",
            fix="call session.initialize() first",
        )

    @staticmethod
    def _check_fields(state: dict[str, Any], call: str) -> None:
        unknown = sorted(set(state) - set(STATE_FIELDS))
        if unknown:
            raise SessionError(
                f"{call} got unknown state field(s) {', '.join(map(repr, unknown))}",
                got=", ".join(unknown),
                expected=f"fields among {', '.join(STATE_FIELDS)}",
            )
