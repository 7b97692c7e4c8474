"""The session: applies a recipe's modifiers to a model with a clear lifecycle (``session.py``);
its status (``status.py``), the order of its events (``order.py``), and one batch of a plain
training loop (``training_step.py``)."""

from llmpress.contract.modifier import EVENTS
from llmpress.session.session import Session, active_session
from llmpress.session.status import Status
from llmpress.session.training_step import TrainingStep

__all__ = ["EVENTS", "Session", "Status", "TrainingStep", "active_session"]
