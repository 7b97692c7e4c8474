"""How llmpress reads model architectures: the class a checkpoint is built as
(``classes``), checkpoint names ↔ model names (``keys``), and MoE experts held one ``Linear`` per
expert (``experts``)."""

from llmpress.models.classes import build, model_class, model_dtype
from llmpress.models.dispatch import dispatch_for_generation
from llmpress.models.experts import (
    ExpertMLP,
    LinearExperts,
    calibrating_all_experts,
    fused_experts,
    linearize_experts,
    routed_experts_only,
)
from llmpress.models.keys import KeyMap

__all__ = [
    "ExpertMLP",
    "KeyMap",
    "LinearExperts",
    "build",
    "calibrating_all_experts",
    "dispatch_for_generation",
    "fused_experts",
    "linearize_experts",
    "model_class",
    "model_dtype",
    "routed_experts_only",
]
