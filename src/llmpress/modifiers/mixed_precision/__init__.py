"""Mixed precision to a budget: a scheme per module, chosen from a menu on calibration data so
that the weights fit a target size (``MixedPrecisionModifier``, or ``mixed_precision`` on any
quantizing modifier)."""

from llmpress.modifiers.mixed_precision.menu import DEFAULT_MENU, MixedPrecision, default_menu  # noqa: F401
