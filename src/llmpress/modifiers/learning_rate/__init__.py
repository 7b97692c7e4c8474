"""Learning-rate schedules set by the recipe, applied to the training loop's optimizer."""

from llmpress.modifiers.learning_rate.modifier import LearningRateModifier, scheduled_lr

__all__ = ["LearningRateModifier", "scheduled_lr"]
