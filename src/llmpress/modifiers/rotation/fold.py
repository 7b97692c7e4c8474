"""Rotations folded into weights, so the checkpoint stays an ordinary one.

With row vectors and a Linear ``y = x Wᵀ``: a reader of the rotated residual stream ``x Q``
takes ``W Q``; a writer into it (``o_proj``, ``down_proj``) gives ``y Q`` with ``Qᵀ W`` and
``b Q``; the embedding table takes ``E Q``. A norm ``x / rms(x) * g`` commutes with ``Q``
(``rms(x Q) = rms(x)``) once its gain ``g`` is 1, so ``g`` goes first into the Linears reading
the norm (their input columns times ``g``). GPT-2's Conv1D (``y = x W``) takes the transposes.
Everything is computed in float64 and rounded once to the weight's dtype; each weight gets a new
tensor, never a write into the file it was mapped from.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpress.models.linear import input_major
from llmpress.modifiers.smoothing.fold import gain_offset
from llmpress.transforms.hadamard import Rotation

__all__ = ["fold_gain_and_rotate_inputs", "rotate_embedding", "rotate_outputs", "unit_gain"]


def _put(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


#: rows of a weight taken into float64 at a time where its rows are rotated independently: an
#: embedding table or output head (SmolLM2's 49152 x 576, 226 MB in float64) never whole in float64
ROWS_AT_ONCE = 4096


def _put_by_rows(param: torch.Tensor, change) -> None:
    """``param`` replaced by ``change(rows in float64)`` computed ``ROWS_AT_ONCE`` rows at a time,
    each block rounded once to the weight's dtype: the same values as the whole matrix at once."""
    source = param.detach()
    result = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    for start in range(0, source.shape[0], ROWS_AT_ONCE):
        result[start : start + ROWS_AT_ONCE] = change(source[start : start + ROWS_AT_ONCE].double())
    param.data = result


@torch.no_grad()
def unit_gain(norm: nn.Module) -> torch.Tensor:
    """Set the norm's gain to 1 (its weight to ``1 - c`` for a ``c + weight`` gain, Gemma's) and
    return the gain it had, in float64."""
    offset = gain_offset(norm)
    gain = norm.weight.detach().double() + offset
    _put(norm.weight, torch.full_like(gain, 1.0 - offset))
    return gain


@torch.no_grad()
def fold_gain_and_rotate_inputs(module: nn.Module, gain: torch.Tensor | None, rotation: Rotation | None) -> None:
    """The module reads ``x * gain`` rotated: ``W diag(gain) Q`` (``Qᵀ diag(gain) W`` for Conv1D)."""

    def change(weight: torch.Tensor) -> torch.Tensor:
        if gain is not None:
            weight = weight * gain.to(weight.device)[None, :]
        return weight if rotation is None else rotation.rows(weight)

    if input_major(module):
        _put(module.weight, change(module.weight.detach().double().T).T)
    else:  # each row on its own: a block of rows at a time (an output head is vocabulary-sized)
        _put_by_rows(module.weight, change)


@torch.no_grad()
def rotate_outputs(module: nn.Module, rotation: Rotation, rows: tuple[int, int] | None = None) -> None:
    """The module's output ``y`` (or its ``rows`` part) becomes ``y Q``: ``Qᵀ W`` and ``b Q``
    (``W Q`` for Conv1D)."""
    start, stop = rows or (0, module.weight.shape[-1] if input_major(module) else module.weight.shape[0])
    weight = module.weight.detach().to(torch.float64, copy=True)  # written in part: never the parameter's own
    if input_major(module):
        weight[:, start:stop] = rotation.rows(weight[:, start:stop])
    else:
        weight[start:stop] = rotation.rows(weight[start:stop].T).T
    _put(module.weight, weight)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias_rotated = bias.detach().to(torch.float64, copy=True)
        bias_rotated[start:stop] = rotation.rows(bias_rotated[start:stop])
        _put(bias, bias_rotated)


@torch.no_grad()
def rotate_embedding(embedding: nn.Module, rotation: Rotation) -> None:
    """Every row of the table ``E`` rotated: ``E Q``, a block of rows at a time."""
    _put_by_rows(embedding.weight, rotation.rows)
