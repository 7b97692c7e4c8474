"""Knowledge distillation from a teacher model during training."""

from llmpress.modifiers.distillation.output import (
    OutputDistillationModifier,
    distillation_loss,
)

__all__ = ["OutputDistillationModifier", "distillation_loss"]
