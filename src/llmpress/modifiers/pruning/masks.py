"""Pruning masks: which weights stay (``True``) and which are zero, unstructured or N:M.

Masks are computed from a score (weight magnitude here) and applied in place after every
optimizer step, so pruned weights stay exactly zero however the optimizer moves them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.models.linear import features, is_linear
from llmpress.targets import assign_by_targets

__all__ = [
    "magnitude_mask",
    "parse_structure",
    "prunable_modules",
]

def parse_structure(text: str) -> tuple[int, int] | None:
    """``"unstructured"`` → None; ``"2:4"`` → (2, 4): keep N of every M consecutive inputs."""
    if text == "unstructured":
        return None
    found = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not found or not 0 < int(found[1]) < int(found[2]):
        raise RecipeError(
            "mask_structure must be 'unstructured' or N:M with 0 < N < M",
            got=repr(text),
            expected="'unstructured', '2:4', '4:8', ...",
        )
    return int(found[1]), int(found[2])


def magnitude_mask(weight: torch.Tensor, sparsity: float, structure: tuple[int, int] | None) -> torch.Tensor:
    """The keep-mask that zeroes ``round(sparsity * numel)`` weights of smallest magnitude.

    With an N:M structure only weights outside the N largest of their block of M may be
    zeroed; below the structure's own sparsity (1 - N/M) the smallest of those go first, so a
    schedule that ends at 1 - N/M ends exactly N:M."""
    score = weight.detach().abs().float()
    count = round(sparsity * score.numel())
    keep = torch.ones(score.shape, dtype=torch.bool, device=score.device)  # contiguous, even for a transposed view
    if count <= 0:
        return keep
    if structure is not None:
        n, m = structure
        blocks = score.reshape(-1, m)
        top = blocks.topk(n, dim=1).indices
        protected = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, top, True).reshape(score.shape)
        score = score.masked_fill(protected, float("inf"))
        count = min(count, int((~protected).sum()))
    pruned = score.flatten().topk(count, largest=False).indices
    keep.view(-1)[pruned] = False
    return keep


def prunable_modules(
    model: nn.Module, targets: list[str], ignore: list[str], modifier: str, structure: tuple[int, int] | None = None
) -> dict[str, nn.Module]:
    """The linear modules ``targets`` match (``Linear`` covers Conv1D), checked against the mask
    structure."""
    chosen = {n: m for n, (m, _) in assign_by_targets(model, [(targets, None)], ignore, linear_alias=True).items() if is_linear(m)}
    if not chosen:
        raise UnsupportedModelError(
            f"{modifier} matched no Linear module",
            got=f"targets={targets}, ignore={ignore}",
            expected="targets that match Linear modules, e.g. [Linear] or ['re:.*proj$']",
        )
    if structure is not None:
        uneven = [n for n, m in chosen.items() if features(m)[0] % structure[1]]
        if uneven:
            raise UnsupportedModelError(
                f"{modifier}: {len(uneven)} module(s) have an input size that is not a multiple of {structure[1]}",
                got=", ".join(uneven[:4]),
                expected=f"input features divisible by M={structure[1]} for {structure[0]}:{structure[1]} sparsity",
                fix="add them to ignore, or use mask_structure: unstructured",
            )
    return chosen
