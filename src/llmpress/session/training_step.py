"""``TrainingStep``: one batch of a plain training loop, its events sent in order
(``session.training_step()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmpress.session.session import Session

__all__ = ["TrainingStep"]


class TrainingStep:
    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> TrainingStep:
        self.session.batch_start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.session.batch_end()
        else:
            self.session.abandon_batch()

    def loss(self, loss: Any) -> Any:
        """Send ``loss_calculated`` and return the loss with every modifier's term added."""
        return self.session.loss_calculated(loss)

    def optimizer_step(self, optimizer: Any, *, scheduler: Any = None) -> None:
        """``optim_pre_step``, ``optimizer.step()``, ``optim_post_step`` (and ``scheduler.step()``)."""
        self.session.optim_pre_step()
        optimizer.step()
        self.session.optim_post_step()
        if scheduler is not None:
            scheduler.step()
