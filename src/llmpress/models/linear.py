"""The modules llmpress quantizes: ``nn.Linear`` and transformers' ``Conv1D``.

``Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, ...) is a linear layer that stores its weight
input-major: ``[in, out]``, computing ``x @ W + b``. llmpress quantizes it as the linear it is
(GPTQ's Hessian is over its inputs, as for any linear) but keeps its own layout on the grid and
in the checkpoint: compressed-tensors takes a weight's qparams from the stored tensor's shape,
so a Conv1D's groups (or channels) run along its last stored dimension, the output features of
one input feature. That is the layout transformers + compressed-tensors read back.

A recipe's ``Linear`` target covers Conv1D (``linear_alias``): the user means "every linear
layer". Conv1D is recognised by its class (transformers' own); a remote-code copy of it is
not. A checkpoint's config is read as compressed-tensors reads it, where ``Linear`` names
``nn.Linear`` only, so llmpress saves quantized Conv1D modules under the ``Conv1D`` target too.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.pytorch_utils import Conv1D

__all__ = ["Conv1D", "features", "input_major", "is_conv1d", "is_linear", "linear_weight"]


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' ``Conv1D``. Transformers is not imported for the question: until
    its ``pytorch_utils`` is, no module can be a Conv1D (the model-free path never imports it)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def __getattr__(name: str) -> Any:
    """``Conv1D`` itself, imported from transformers when first asked for."""
    if name == "Conv1D":
        from transformers.pytorch_utils import Conv1D

        return Conv1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def input_major(module: nn.Module) -> bool:
    """True when the module stores its weight ``[in, out]``: a Conv1D, or a runtime module
    standing for one."""
    return is_conv1d(module) or getattr(module, "input_major", False) is True


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear module."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def linear_weight(weight: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``module``'s ``weight`` as ``[out, in]``: a transposed view for an input-major module (what
    per-input structure, such as N:M sparsity, is read along)."""
    return weight.t() if input_major(module) else weight
