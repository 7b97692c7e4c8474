"""Data-free recipes applied to a checkpoint's safetensors shards without building the model
(``run.py``), where the tensors' names say what the recipe means (``plan.py``)."""

from llmpress.model_free.plan import ModelFreePlan, ModelFreeRefused, plan_model_free
from llmpress.model_free.run import default_workers, quantize_model_free, run_plan

__all__ = ["ModelFreePlan", "ModelFreeRefused", "default_workers", "plan_model_free", "quantize_model_free", "run_plan"]
