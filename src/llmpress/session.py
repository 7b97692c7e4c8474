"""The session: applies a recipe's modifiers to a model with a clear lifecycle.

1. ``Session(recipe)``; ``with session:`` makes it the active one (context-local).
2. ``update_state(model=..., optimizer=..., ...)`` any number of times: it only records.
3. ``initialize(**overrides)`` once: every modifier checks what it needs and sets up.
4. Events: training (``batch_start``, ``loss_calculated``, ``optim_pre_step``, ``optim_post_step``,
   ``batch_end``) and one-shot (``calibration_start``, ``modules_calibrated`` (a group of a block's
   modules, when the pipeline goes module by module), ``layer_calibrated``, ``calibration_end``).
   ``optim_post_step`` counts optimizer steps; with ``steps_per_epoch`` they give the epoch, and
   a modifier with ``start`` / ``end`` (epochs) gets training events only inside that window.
5. ``finalize()`` makes the result permanent and ends the session.

Out-of-order calls raise ``SessionError``; nothing is ever a silent no-op. One training batch is
``batch_start``, any number of ``loss_calculated`` (gradient accumulation), at most one
``optim_pre_step`` / ``optim_post_step`` pair, then ``batch_end``.
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

__all__ = ["EVENTS", "Session", "active_session"]

logger = logging.getLogger(__name__)

TRAINING_EVENTS = ("batch_start", "loss_calculated", "optim_pre_step", "optim_post_step", "batch_end")
ONESHOT_EVENTS = ("calibration_start", "modules_calibrated", "layer_calibrated", "calibration_end")
EVENTS = TRAINING_EVENTS + ONESHOT_EVENTS

# which events may come next, by where the session is in a batch or a calibration
_NEXT: dict[str, tuple[str, ...]] = {
    "idle": ("batch_start", "calibration_start"),
    "batch": ("loss_calculated", "optim_pre_step", "batch_end"),
    "optimizer": ("optim_post_step",),
    "stepped": ("loss_calculated", "batch_end"),
    "calibration": ("modules_calibrated", "layer_calibrated", "calibration_end"),
}
_AFTER: dict[str, str] = {
    "batch_start": "batch",
    "optim_pre_step": "optimizer",
    "optim_post_step": "stepped",
    "batch_end": "idle",
    "calibration_start": "calibration",
    "calibration_end": "idle",
}
_PHASE_WORDS = {
    "idle": "between batches",
    "batch": "inside a batch",
    "optimizer": "between optim_pre_step and optim_post_step",
    "stepped": "after this batch's optimizer step",
    "calibration": "during calibration",
}

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
        self._phase = "idle"
        self._losses_in_batch = 0
        self._trained = False
        self._window: dict[int, str] = {}  # id(modifier) -> "open" / "closed" once it changed
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
        self._record_recipe()
        return self

    def finalize(self) -> Session:
        """Make every modifier's result permanent and end the session."""
        self._require(Status.INITIALIZED, "finalize")
        if self._phase != "idle":
            raise SessionError(
                "finalize() called " + _PHASE_WORDS[self._phase],
                got=f"no {'calibration_end' if self._phase == 'calibration' else 'batch_end'} yet",
                expected="finalize() between batches, after calibration_end()",
                fix="send the closing event first",
            )
        if self._trained:
            unopened = [type(m).__name__ for m in self.modifiers if m.config_has_window and id(m) not in self._window]
            if unopened:
                logger.warning(
                    "%s never reached the start of its window (training ended at epoch %.2f); "
                    "finalize() applies it without training", ", ".join(unopened), self.state.epoch,
                )
        for modifier in self.modifiers:
            modifier.finalize(self.state)
        self.status = Status.FINALIZED
        return self

    def _record_recipe(self) -> None:
        """The model's record of how it was made gains this session's stages (they apply from
        now on, so a checkpoint saved mid-training says so), and its saves go through llmpress."""
        model = self.state.get("model")
        if model is not None and self.recipe.stages:
            applied = getattr(model, APPLIED_RECIPE_ATTR, None) or Recipe()
            setattr(model, APPLIED_RECIPE_ATTR, applied + self.recipe)
            route_save_pretrained(model)

    # -- where training is ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed (``optim_post_step`` events)."""
        return self.state.step

    @property
    def epoch(self) -> float:
        return self.state.epoch

    def resume_at(self, step: int) -> Session:
        """Continue a training run from ``step`` optimizer steps (a resumed checkpoint): windows
        that already closed are opened and closed once, so their results (final masks, the
        last learning rate) hold; the others open at the next ``batch_start`` as usual."""
        self._require(Status.INITIALIZED, "resume_at")
        if self._phase != "idle" or self.state.step or self._window:
            raise SessionError(
                "resume_at() called after training events",
                got=f"{self.state.step} step(s) already counted",
                expected="resume_at(step) right after initialize(), before the first batch_start",
            )
        self.state.step = int(step)
        epoch = self.state.epoch
        for modifier in self.modifiers:
            end = getattr(modifier.config, "end", None)
            if end is not None and epoch >= end:
                self._window[id(modifier)] = "closed"
                modifier.on_window_start(self.state)
                modifier.on_window_end(self.state)
        return self

    def abandon_batch(self) -> None:
        """The loop failed inside a batch: go back to between batches without sending events."""
        self._phase = "idle"

    def training_step(self):
        """A context manager for one batch of a plain training loop::

            with session.training_step() as step:
                loss = step.loss(model(**batch).loss)
                loss.backward()
                step.optimizer_step(optimizer)   # optim_pre_step, optimizer.step(), optim_post_step
                optimizer.zero_grad()
        """
        from llmpress.pipelines.training import TrainingStep

        return TrainingStep(self)

    # -- events ------------------------------------------------------------------------------
    def event(self, name: str, **payload: Any) -> Any:
        """Send an event to the modifiers that act on it. ``loss_calculated`` returns the loss
        after every modifier had its say; other events return None."""
        if name not in EVENTS:
            raise SessionError(f"unknown event {name!r}", expected=f"one of {', '.join(EVENTS)}")
        self._require(Status.INITIALIZED, f"event {name!r}")
        self._check_order(name)
        if name == "batch_start":
            self._trained = True
            self._open_windows()
            self._losses_in_batch = 0
        elif name == "loss_calculated":
            self._losses_in_batch += 1
        elif name == "batch_end":
            self._check_loss_was_sent()
        training = name in TRAINING_EVENTS
        for modifier in self.modifiers:
            if name not in modifier.events or (training and not self._reaches(modifier)):
                continue
            result = modifier.on_event(name, self.state, **payload)
            if name == "loss_calculated" and result is not None:
                payload["loss"] = result
        self._phase = _AFTER.get(name, self._phase)
        if name == "optim_post_step":
            self.state.step += 1
            self._close_windows()
        return payload.get("loss") if name == "loss_calculated" else None

    def _check_order(self, name: str) -> None:
        allowed = _NEXT[self._phase]
        if name in allowed:
            return
        raise SessionError(
            f"event {name!r} out of order: it came {_PHASE_WORDS[self._phase]}",
            got=name,
            expected=f"next one of {', '.join(allowed)}",
            fix="send a batch as batch_start, loss_calculated, optim_pre_step, optim_post_step, batch_end "
            "(session.training_step() does this), and calibration as calibration_start ... calibration_end",
        )

    def _reaches(self, modifier: Modifier) -> bool:
        window = self._window.get(id(modifier))
        return window == "open" or (window == "closed" and modifier.acts_after_window)

    def _open_windows(self) -> None:
        epoch = self.state.epoch
        for modifier in self.modifiers:
            if self._window.get(id(modifier)) is None and modifier.active_at(epoch):
                self._window[id(modifier)] = "open"
                modifier.on_window_start(self.state)

    def _close_windows(self) -> None:
        epoch = self.state.epoch
        for modifier in self.modifiers:
            if self._window.get(id(modifier)) == "open" and not modifier.active_at(epoch):
                self._window[id(modifier)] = "closed"
                modifier.on_window_end(self.state)

    def _check_loss_was_sent(self) -> None:
        if self._losses_in_batch:
            return
        needing = [
            type(m).__name__
            for m in self.modifiers
            if "loss_calculated" in m.events and self._window.get(id(m)) == "open"
        ]
        if needing:
            raise SessionError(
                f"{', '.join(needing)} change(s) the loss, but this batch sent no loss_calculated event",
                got="batch_end without loss_calculated",
                expected="loss = session.loss_calculated(loss) before backward()",
                fix="use step.loss(loss) in session.training_step(), or llmpress's LlmpressTrainer "
                "(a TrainerCallback alone cannot change the loss)",
            )

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

    def modules_calibrated(self, index: int, layer: Any, modules: list[Any]) -> None:
        """``modules`` of block ``index`` have seen all their calibration inputs: the modifiers
        compress them now, before later modules of the block are calibrated on their outputs."""
        self.event("modules_calibrated", index=index, layer=layer, modules=modules)

    def layer_calibrated(self, index: int, layer: Any) -> None:
        self.event("layer_calibrated", index=index, layer=layer)

    def calibration_end(self) -> None:
        self.event("calibration_end")

    def step_notes(self) -> str:
        """The modifiers' notes on their last step, for a progress bar."""
        return "; ".join(note for m in self.modifiers if (note := m.step_note()))

    @property
    def needs_calibration_forward(self) -> bool:
        """Whether any modifier needs calibration batches to flow through the model."""
        return any(getattr(m, "needs_calibration_forward", False) for m in self.modifiers)

    @property
    def calibrates_by_module(self) -> bool:
        """Whether every modifier that watches the calibration forward can compress a block's
        modules group by group (``modules_calibrated``), as module-by-module calibration needs."""
        watching = [m for m in self.modifiers if getattr(m, "needs_calibration_forward", False)]
        return bool(watching) and all("modules_calibrated" in m.events for m in watching)

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
