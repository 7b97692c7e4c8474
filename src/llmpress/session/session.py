"""The session: applies a recipe's modifiers to a model with a clear lifecycle.

1. ``Session(recipe)``; ``with session:`` makes it the active one (context-local).
2. ``update_state(model=..., optimizer=..., ...)`` any number of times: it only records.
3. ``initialize(**overrides)`` once: every modifier checks what it needs and sets up.
4. Events: training (``batch_start``, ``loss_calculated``, ``optim_pre_step``, ``optim_post_step``,
   ``batch_end``) and one-shot (``calibration_start``, ``block_start`` (a block is next:
   transforms act), ``modules_calibrated`` (a group of a block's modules, when the pipeline goes
   module by module), ``layer_calibrated``, ``layer_restored`` (a resumed run put back a block an
   earlier run finished), ``calibration_end``).
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
from typing import TYPE_CHECKING, Any

from llmpress.checkpoint.save_pretrained import route_save_pretrained
from llmpress.contract.modifier import EVENTS, STATE_FIELDS, TRAINING_EVENTS, Modifier, State
from llmpress.contract.observation import Observation
from llmpress.errors import MissingStateError, SessionError
from llmpress.lifecycle.records import applied_recipe, record_recipe
from llmpress.parallel.distributed import require_reducing_modifiers
from llmpress.recipe import Recipe
from llmpress.session.order import PHASE_WORDS, check_order, phase_after
from llmpress.session.status import Status, require_status
from llmpress.session.training_step import TrainingStep

if TYPE_CHECKING:
    from torch import nn

    from llmpress.contract.block import CalibrationBlock

__all__ = ["Session", "active_session"]

logger = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("llmpress_session", default=None)


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
        #: what the model records of this session (``_record_recipe``): copies without the running
        #: modifiers' state, each told at finalize what it should say (``Modifier.record_into``)
        self._records: list[Modifier] = [m.clone() for m in self.modifiers]
        self.state = State()
        self.status = Status.CREATED
        self._phase = "idle"
        self._losses_in_batch = 0
        self._trained = False
        self.observation: Observation | None = None  # between calibration_start and calibration_end
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
        require_status(self.status, Status.CREATED, "update_state")
        self._check_fields(state, "update_state")
        self.state.update({k: v for k, v in state.items() if v is not None})
        return self

    def initialize(self, **overrides: Any) -> Session:
        """Initialize every modifier exactly once with the recorded state (overrides win)."""
        require_status(self.status, Status.CREATED, "initialize")
        self._check_fields(overrides, "initialize")
        self.state.update({k: v for k, v in overrides.items() if v is not None})
        for modifier in self.modifiers:  # every need is checked before any modifier acts
            self._check_required_state(modifier)
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
        require_status(self.status, Status.INITIALIZED, "finalize")
        if self._phase != "idle":
            raise SessionError(
                "finalize() called " + PHASE_WORDS[self._phase],
                got=f"no {'calibration_end' if self._phase == 'calibration' else 'batch_end'} yet",
                expected="finalize() between batches, after calibration_end()",
                fix="send the closing event first",
            )
        if self._trained:
            unopened = [type(m).__name__ for m in self.modifiers if m.window.state == "waiting"]
            if unopened:
                logger.warning(
                    "%s never reached the start of its window (training ended at epoch %.2f); "
                    "finalize() applies it without training", ", ".join(unopened), self.state.epoch,
                )
        for modifier, record in zip(self.modifiers, self._records):
            modifier.finalize(self.state)
            modifier.record_into(record)
        self.status = Status.FINALIZED
        return self

    def _record_recipe(self) -> None:
        """The model's record of how it was made gains this session's stages (they apply from
        now on, so a checkpoint saved mid-training says so), and its saves go through llmpress."""
        model = self.state.get("model")
        if model is not None and self.recipe.stages:
            record_recipe(model, (applied_recipe(model) or Recipe()) + self.recipe.with_modifiers(self._records))
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
        require_status(self.status, Status.INITIALIZED, "resume_at")
        if self._phase != "idle" or self.state.step or any(m.window.state != "waiting" for m in self.modifiers):
            raise SessionError(
                "resume_at() called after training events",
                got=f"{self.state.step} step(s) already counted",
                expected="resume_at(step) right after initialize(), before the first batch_start",
            )
        self.state.step = int(step)
        epoch = self.state.epoch
        for modifier in self.modifiers:
            if modifier.window.has_passed(epoch):
                modifier.window.state = "closed"
                modifier.on_window_start(self.state)
                modifier.on_window_end(self.state)
        return self

    def abandon_batch(self) -> None:
        """The loop failed inside a batch: go back to between batches without sending events."""
        self._phase = "idle"

    def abandon_calibration(self) -> None:
        """Calibration failed part way: the observation hooks leave the model, and the session
        is over (its modifiers may have compressed some modules and not others)."""
        self._end_observation()
        self._phase = "idle"
        self.status = Status.FAILED

    def training_step(self):
        """A context manager for one batch of a plain training loop::

            with session.training_step() as step:
                loss = step.loss(model(**batch).loss)    # modifiers may add to it (distillation)
                loss.backward()
                step.optimizer_step(optimizer)   # optim_pre_step, optimizer.step(), optim_post_step
                optimizer.zero_grad()

        Entering sends ``batch_start``; leaving sends ``batch_end``. A batch without an optimizer
        step (gradient accumulation) is fine: call ``step.loss`` and leave the block.
        """
        return TrainingStep(self)

    # -- events ------------------------------------------------------------------------------
    def event(self, name: str, **payload: Any) -> Any:
        """Send an event to the modifiers that act on it. ``loss_calculated`` returns the loss
        after every modifier had its say; other events return None."""
        if name not in EVENTS:
            raise SessionError(f"unknown event {name!r}", expected=f"one of {', '.join(EVENTS)}")
        require_status(self.status, Status.INITIALIZED, f"event {name!r}")
        check_order(self._phase, name)
        if name == "batch_start":
            self._trained = True
            self._open_windows()
            self._losses_in_batch = 0
        elif name == "loss_calculated":
            self._losses_in_batch += 1
        elif name == "batch_end":
            self._check_loss_was_sent()
        if name == "calibration_start":
            require_reducing_modifiers(self.modifiers)  # on several ranks
        if name == "calibration_end":
            self._end_observation()
        training = name in TRAINING_EVENTS
        for modifier in self.modifiers:
            if name not in modifier.events or (training and not self._reaches(modifier)):
                continue
            result = getattr(modifier, f"on_{name}")(self.state, **payload)
            if name == "loss_calculated" and result is not None:
                payload["loss"] = result
        if name == "calibration_start":
            self.observation = Observation(self.modifiers)
        self._phase = phase_after(self._phase, name)
        if name == "optim_post_step":
            self.state.step += 1
            self._close_windows()
        return payload.get("loss") if name == "loss_calculated" else None

    @staticmethod
    def _reaches(modifier: Modifier) -> bool:
        state = modifier.window.state
        return state == "open" or (state == "closed" and modifier.acts_after_window)

    def _open_windows(self) -> None:
        for modifier in self.modifiers:
            if modifier.window.open_if_reached(self.state.epoch):
                modifier.on_window_start(self.state)

    def _close_windows(self) -> None:
        for modifier in self.modifiers:
            if modifier.window.close_if_passed(self.state.epoch):
                modifier.on_window_end(self.state)

    def _end_observation(self) -> None:
        if self.observation is not None:
            self.observation.remove()
            self.observation = None

    def _check_loss_was_sent(self) -> None:
        if self._losses_in_batch:
            return
        needing = [
            type(m).__name__
            for m in self.modifiers
            if "loss_calculated" in m.events and m.window.state == "open"
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

    def block_start(self, block: CalibrationBlock) -> None:
        """``block`` is next, its inputs ready, nothing of it observed or compressed yet: the
        modifiers that transform a block before it is quantized (smoothing scales) act now."""
        self.event("block_start", block=block)

    def modules_calibrated(self, block: CalibrationBlock, modules: list[nn.Module]) -> None:
        """``modules`` of ``block`` have seen all their calibration inputs: the modifiers
        compress them now, before later modules of the block are calibrated on their outputs."""
        self.event("modules_calibrated", block=block, modules=modules)

    def layer_calibrated(self, block: CalibrationBlock) -> None:
        """Every module of ``block`` has seen its calibration inputs; the block's outputs are
        computed (compressed) after this."""
        self.event("layer_calibrated", block=block)

    def layer_restored(self, block: CalibrationBlock) -> None:
        """``block`` is back as an earlier, interrupted run of this recipe finished it (a resumed
        run): the modifiers count its modules done, without observing or compressing them."""
        self.event("layer_restored", block=block)

    @property
    def restores_layers(self) -> bool:
        """Whether every modifier that takes part in calibration can take a restored block
        (``on_layer_restored``), so that a run can resume."""
        return all("layer_restored" in m.events for m in self.modifiers
                   if m.calibration_targets() or "block_start" in m.events or m.runs_blocks() or "layer_calibrated" in m.events)

    def resume_notes(self) -> list:
        """Each modifier's note to keep with a finished layer (``Modifier.resume_note``)."""
        return [m.resume_note() for m in self.modifiers]

    def take_resume_notes(self, notes: list | None) -> None:
        """A resumed run: give each modifier the note it kept (``Modifier.take_resume_note``)."""
        if notes is not None and len(notes) == len(self.modifiers):
            for modifier, note in zip(self.modifiers, notes):
                if note is not None:
                    modifier.take_resume_note(note)

    def calibration_end(self) -> None:
        self.event("calibration_end")

    def step_notes(self) -> str:
        """The modifiers' notes on their last step, for a progress bar."""
        return "; ".join(note for m in self.modifiers if (note := m.step_note()))

    @property
    def needs_calibration_forward(self) -> bool:
        """Whether any modifier observes calibration inputs or transforms blocks on them (so
        batches must flow)."""
        return any(m.calibration_targets() or "block_start" in m.events or m.runs_blocks() for m in self.modifiers)

    @property
    def calibrates_by_module(self) -> bool:
        """Whether the modifiers allow module-by-module calibration: every one that observes
        calibration inputs or acts at ``layer_calibrated`` compresses group by group
        (``modules_calibrated``), so nothing changes a block after its stages."""
        acting = [m for m in self.modifiers if m.calibration_targets() or "layer_calibrated" in m.events]
        return any(m.calibration_targets() for m in acting) and all("modules_calibrated" in m.events for m in acting)

    # -- checks ------------------------------------------------------------------------------
    def _check_required_state(self, modifier: Modifier) -> None:
        needs = list(modifier.required_state())
        if modifier.window.is_timed and "steps_per_epoch" not in needs:
            needs.append("steps_per_epoch")  # for its start/end window
        for field in needs:
            if self.state.get(field) is not None:
                continue
            window = field == "steps_per_epoch" and "steps_per_epoch" not in modifier.required_state()
            raise MissingStateError(
                f"{type(modifier).__name__} needs {field!r}"
                + (" for its start/end window (epochs)" if window else "")
                + f": call session.update_state({field}=...) before initialize()",
                got=f"no {field}",
                expected=STATE_FIELDS.get(field, field),
                fix="one-shot runs have no epochs: remove start/end from the recipe there" if window else None,
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
