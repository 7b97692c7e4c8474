"""``run_training``: the small causal-LM loop ``llmpress.train`` runs for a recipe's training
stages, built on ``session.training_step()`` as any training loop can be (``session.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import DataError

if TYPE_CHECKING:
    from llmpress.session import Session

__all__ = ["TrainingOptions", "run_training", "stage_epochs"]

logger = logging.getLogger(__name__)


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
