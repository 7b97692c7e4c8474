"""A session's status (created, initialized, finalized, failed) and the check that a call comes
at the one status where it may."""

from __future__ import annotations

from enum import Enum

from llmpress.errors import SessionError

__all__ = ["Status", "require_status"]


class Status(str, Enum):
    CREATED = "created"
    INITIALIZED = "initialized"
    FINALIZED = "finalized"
    FAILED = "failed"  # initialize() or calibration raised after modifiers began to change the model


def require_status(status: Status, wanted: Status, call: str) -> None:
    """Refuse ``call`` on a session at ``status`` unless it is ``wanted``, saying what to do."""
    if status == wanted:
        return
    if status == Status.FAILED:
        raise SessionError(
            f"{call} called on a session that failed part way",
            got="a failed session (its modifiers may have changed the model part way)",
            fix="reload the model and create a new llmpress.Session(recipe)",
        )
    if status == Status.FINALIZED:
        raise SessionError(
            f"{call} called after finalize(): the session has ended",
            got="a finalized session",
            fix="create a new llmpress.Session(recipe) for more work",
        )
    if status == Status.INITIALIZED:
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
