"""The session inside a plain PyTorch training loop: one ``with`` block per batch.

::

    with session.training_step() as step:
        loss = step.loss(model(**batch).loss)      # modifiers may add to it (distillation)
        loss.backward()
        step.optimizer_step(optimizer)             # pruning masks, QAT, learning rate act here
        optimizer.zero_grad()

Entering sends ``batch_start``; leaving sends ``batch_end``. A batch without an optimizer step
(gradient accumulation) is fine: call ``step.loss`` and leave the block.

``run_training`` is the small causal-LM loop ``llmpress.train`` uses for a recipe's training
stages; it is built on the same ``training_step``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import DataError

if TYPE_CHECKING:
    from llmpress.session import Session

__all__ = ["TrainingOptions", "TrainingStep", "run_training", "stage_epochs"]

logger = logging.getLogger(__name__)


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


@dataclass
class TrainingOptions:
    """The plain loop ``llmpress.train`` runs for a recipe's training stages."""

    #: epochs over the training samples (fractions allowed); ``None``: the latest ``end`` of the
    #: stage's modifiers, else 1
    epochs: float | None = None
    #: stop after this many optimizer steps, whatever ``epochs`` says
    max_steps: int | None = None
    lr: float = 1e-4
    weight_decay: float = 0.0
    batch_size: int = 4
    seq_len: int = 256
    #: training samples of ``seq_len`` tokens taken from the dataset (None: all)
    num_samples: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps", "lr", "batch_size", "seq_len", "num_samples"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise DataError(f"TrainingOptions.{name} must be positive", got=value, expected="> 0")


def stage_epochs(session: Session, options: TrainingOptions) -> float:
    """``options.epochs``, else long enough for every window: the latest ``end``, and one epoch
    past a ``start`` that has no end."""
    if options.epochs is not None:
        return options.epochs
    needed = [1.0]
    for modifier in session.modifiers:
        start, end = getattr(modifier.config, "start", 0.0), getattr(modifier.config, "end", None)
        needed.append(end if end is not None else start + 1.0)
    return max(needed)


def run_training(
    model: nn.Module,
    session: Session,
    batches: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: float,
    max_steps: int | None = None,
    seed: int = 0,
) -> list[float]:
    """Causal-LM training on ``batches`` (``[batch, seq]`` token ids), one optimizer step per
    batch, shuffled each epoch; returns the loss of every step (after the modifiers' terms)."""
    steps = math.ceil(epochs * len(batches))
    if max_steps is not None:
        steps = min(steps, max_steps)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses: list[float] = []
    model.train()
    bar = tqdm(total=steps, desc="Training", unit="step", leave=False, disable=None)
    try:
        for _ in range(steps):
            if not order:
                order = torch.randperm(len(batches), generator=generator).tolist()
            batch = batches[order.pop()].to(device)
            with session.training_step() as step:
                loss = step.loss(model(input_ids=batch, labels=batch).loss)
                loss.backward()
                step.optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", epoch=f"{session.epoch:.2f}")
    finally:
        bar.close()
        model.eval()
    logger.info("trained %d steps, loss %.4f -> %.4f", len(losses), losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"))
    return losses
