"""The session inside a plain PyTorch training loop: one ``with`` block per batch.

::

    with session.training_step() as step:
        loss = step.loss(model(**batch).loss)      # modifiers may add to it (distillation)
        loss.backward()
        step.optimizer_step(optimizer)             # pruning masks, QAT, learning rate act here
        optimizer.zero_grad()

Entering sends ``batch_start``; leaving sends ``batch_end``. A batch without an optimizer step
(gradient accumulation) is fine: call ``step.loss`` and leave the block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmpress.session import Session

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
        else:  # the loop failed inside the batch: leave the session between batches, send nothing
            self.session._phase = "idle"

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
