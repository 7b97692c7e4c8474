"""Where a session is between its events (its phase), and which event may come next.

A batch is ``batch_start``, any number of ``loss_calculated``, at most one ``optim_pre_step`` /
``optim_post_step`` pair, then ``batch_end``; calibration is ``calibration_start``, the block
events, then ``calibration_end``. Anything else is refused with the order that was expected.
"""

from __future__ import annotations

from llmpress.errors import SessionError

__all__ = ["PHASE_WORDS", "check_order", "phase_after"]

# which events may come next, by where the session is in a batch or a calibration
NEXT: dict[str, tuple[str, ...]] = {
    "idle": ("batch_start", "calibration_start"),
    "batch": ("loss_calculated", "optim_pre_step", "batch_end"),
    "optimizer": ("optim_post_step",),
    "stepped": ("loss_calculated", "batch_end"),
    "calibration": ("block_start", "modules_calibrated", "layer_calibrated", "layer_restored", "calibration_end"),
}
AFTER: dict[str, str] = {
    "batch_start": "batch",
    "optim_pre_step": "optimizer",
    "optim_post_step": "stepped",
    "batch_end": "idle",
    "calibration_start": "calibration",
    "calibration_end": "idle",
}
PHASE_WORDS = {
    "idle": "between batches",
    "batch": "inside a batch",
    "optimizer": "between optim_pre_step and optim_post_step",
    "stepped": "after this batch's optimizer step",
    "calibration": "during calibration",
}


def check_order(phase: str, name: str) -> None:
    """Refuse event ``name`` where it cannot come ``phase``."""
    allowed = NEXT[phase]
    if name in allowed:
        return
    raise SessionError(
        f"event {name!r} out of order: it came {PHASE_WORDS[phase]}",
        got=name,
        expected=f"next one of {', '.join(allowed)}",
        fix="send a batch as batch_start, loss_calculated, optim_pre_step, optim_post_step, batch_end "
        "(session.training_step() does this), and calibration as calibration_start ... calibration_end",
    )


def phase_after(phase: str, name: str) -> str:
    """The phase once event ``name`` came in ``phase``."""
    return AFTER.get(name, phase)
