"""Checkpoint names ↔ model names, as transformers' ``from_pretrained`` and ``save_pretrained``
map them.

A checkpoint's tensor names are not always the model's: GPT-NeoX stores its head as
``embed_out`` (the model calls it ``lm_head``), Mixtral its MoE layers as ``block_sparse_moe``
(``mlp``), and a checkpoint of a base model (``BertModel``) lacks the ``bert.`` prefix that a model
with a head has. transformers keeps these renamings in its conversion mapping; this module
applies transformers' own renamings (never a copy of its tables) and the base-model prefix, both
ways. The mapping's expert converters (per-expert tensors merged into fused 3-D parameters) are
not needed: llmpress holds experts per expert (``models.experts``).
"""

from __future__ import annotations

import logging

from torch import nn

from llmpress.compat import conversion_mapping, is_prefix_change, is_renaming

__all__ = ["KeyMap"]

logger = logging.getLogger(__name__)


def _renamings(model: nn.Module, *, for_saving: bool) -> list:
    # saving writes the layout transformers would (no legacy renamings, no prefix changes
    # guessed for a model that was not loaded by from_pretrained), as save_pretrained does
    renamings = [c for c in conversion_mapping(model, add_legacy=not for_saving) if is_renaming(c)]
    if for_saving:
        renamings = [c.reverse_transform() for c in renamings[::-1] if not is_prefix_change(c)]
    return renamings


class KeyMap:
    """How tensors of ``model`` are named in a checkpoint."""

    def __init__(self, model: nn.Module) -> None:
        self._load = _renamings(model, for_saving=False)
        self._save = _renamings(model, for_saving=True)
        self._prefix = getattr(model, "base_model_prefix", "") or ""
        self._modules = {name for name, _ in model.named_modules()}

    def _renamed(self, key: str, renamings: list) -> str:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    def to_model(self, key: str) -> str:
        """The model's name for checkpoint tensor ``key`` (the key itself when nothing maps)."""
        key = self._renamed(key, self._load)
        owner = key.rpartition(".")[0]
        if self._prefix and owner not in self._modules:
            stripped = key.removeprefix(self._prefix + ".")
            if stripped != key and stripped.rpartition(".")[0] in self._modules:
                return stripped  # a base model's weights in a model with a head, or the reverse
            if f"{self._prefix}.{owner}" in self._modules:
                return f"{self._prefix}.{key}"
        return key

    def to_checkpoint(self, key: str) -> str:
        """The name transformers' ``save_pretrained`` would write for model tensor ``key``."""
        return self._renamed(key, self._save)
