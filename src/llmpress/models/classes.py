"""Which model class a checkpoint is built as: the one its config names, as ``from_pretrained``
does (``BertModel`` for a sentence-embedding checkpoint, ``LlavaForConditionalGeneration`` for a
vision-language one), else the causal-LM Auto class, else the base model; and the dtype a built
model computes in."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmpress.errors import UnsupportedModelError

__all__ = ["build", "model_class", "model_dtype"]


def model_class(config: Any):
    """A class with ``from_config``/``_from_config`` for ``config``."""
    import transformers

    names = getattr(config, "architectures", None) or []
    for name in names if isinstance(names, (list, tuple)) else []:  # a config may hold anything there
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in auto._model_mapping or getattr(config, "auto_map", None):
            return auto
    raise UnsupportedModelError(
        "transformers has no model class for this config",
        got=f"model_type {getattr(config, 'model_type', '?')!r}, architectures {getattr(config, 'architectures', None)}",
        expected="an architecture transformers knows (or remote code with trust_remote_code)",
    )


def build(cls, config: Any, **kwargs: Any):
    """``cls`` built from ``config``: Auto classes through ``from_config`` (with
    ``trust_remote_code``, False unless given), others ``_from_config``."""
    trust_remote_code = kwargs.pop("trust_remote_code", False)
    if hasattr(cls, "from_config") and cls.__module__.startswith("transformers.models.auto"):
        return cls.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    return cls._from_config(config, **kwargs)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
