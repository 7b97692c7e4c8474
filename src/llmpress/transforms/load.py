"""Reading a checkpoint's online rotations back (``loading/compressed_tensors.py`` calls this):
which modules get which rotation is planned on the model's skeleton (class names match there),
the stored matrices are claimed as they stream in, and the rotations are attached once every
tensor is in place (a dequantized module is a new module by then).

``q_attn`` / ``k_cache`` entries (SpinQuant's R3) rotate the queries and the keys alike, which
leaves ``q kᵀ`` as it is: with the attention and the KV cache at full precision the model computes
the same function without them, so they are skipped (said in the log); with a quantized KV cache
they would change what is stored, and the checkpoint is refused with that reason.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmpress.errors import CheckpointError
from llmpress.lifecycle.records import record_transform_group
from llmpress.targets import matches
from llmpress.transforms.config import TransformArgs, TransformConfig, TransformScheme
from llmpress.transforms.online import OnlineTransform, attach

__all__ = ["StoredTransforms"]

logger = logging.getLogger(__name__)


class StoredTransforms:
    """A checkpoint's online rotations, from its plan to the attached modules."""

    def __init__(self, config: TransformConfig, kv_cache_quantized: bool) -> None:
        self.config = config
        attention = [(g, a) for g, _, a in config.online() if a.location in ("q_attn", "k_cache")]
        if attention and kv_cache_quantized:
            raise CheckpointError(
                f"the checkpoint rotates queries and keys at run time (group {attention[0][0]!r}, {attention[0][1].location}) "
                "before a quantized KV cache, which llmpress.load cannot apply",
                expected="no q_attn / k_cache rotation, or a KV cache at full precision")
        if attention:
            logger.info("transform group(s) %s rotate queries and keys alike, which leaves their products as they are at "
                        "full precision: not applied", sorted({g for g, _ in attention}))
        self.entries = [(g, s, a) for g, s, a in config.online() if a.location in ("input", "output")]
        self.names = {f"{g}_{a.location}" for g, _, a in self.entries}
        self.plan: dict[str, list[tuple[str, TransformScheme, TransformArgs]]] = {}
        self.stored: dict[str, torch.Tensor] = {}

    def plan_for(self, model: nn.Module) -> None:
        """Which modules of the skeleton each online entry targets."""
        for name, module in model.named_modules():
            for group, scheme, args in self.entries:
                if matches(name, module, args.targets) and not matches(name, module, args.ignore):
                    self.plan.setdefault(name, []).append((group, scheme, args))

    def claims(self, key: str) -> bool:
        owner, _, local = key.rpartition(".")
        return local in ("weight", "perm") and owner.rpartition(".")[2] in self.names

    def keep(self, key: str, tensor: torch.Tensor) -> None:
        self.stored[key] = tensor

    def _matrix(self, name: str, group: str, location: str, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The module's own stored matrix, else the one its group stores for its size (a
        checkpoint keeps a shared matrix once, under the first module's name)."""
        prefix = f"{name}.{group}_{location}."
        if prefix + "weight" in self.stored:
            return self.stored[prefix + "weight"], self.stored.get(prefix + "perm")
        suffix = f".{group}_{location}.weight"
        for key, tensor in self.stored.items():
            if key.endswith(suffix) and tensor.shape[0] == size:
                return tensor, self.stored.get(key.removesuffix("weight") + "perm")
        raise CheckpointError(f"the checkpoint has no {group} rotation of size {size} for {name!r}",
                              got=f"stored: {sorted({k for k in self.stored if k.endswith(suffix)})[:3]}",
                              expected=f"a tensor {prefix}weight, or one of that size under another module")

    def attach_all(self, model: nn.Module) -> int:
        """Attach every planned rotation; returns how many."""
        made: dict[tuple[int, int, bool], OnlineTransform] = {}
        count = 0
        for name, entries in self.plan.items():
            module = model.get_submodule(name)
            for group, scheme, args in entries:
                features = module.in_features if args.location == "input" else module.out_features
                size = scheme.head_dim or features
                stored, perm = self._matrix(name, group, args.location, size)
                key = (id(stored), id(perm), args.inverse)
                first = made.get(key)
                transform = OnlineTransform(stored, scheme.type, args.location, args.inverse, perm,
                                            shared=None if first is None else first.shared)
                made.setdefault(key, transform)
                attach(module, f"{group}_{args.location}", transform)
                count += 1
        for group, scheme in self.config.config_groups.items():
            record_transform_group(model, group, scheme)
        return count
