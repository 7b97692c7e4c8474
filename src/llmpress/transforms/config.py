"""compressed-tensors' ``transform_config`` (``quantization_config.transform_config`` in a
checkpoint's config.json), read and written in its own JSON.

A config group is one family of matrices (QuIP's ``v``, SpinQuant's ``R4``); each of its ``apply``
entries names modules and where the matrix acts on them:

- ``weight_input`` / ``weight_output``: folded into the stored weight (``W Tᵀ`` / ``Tᵀ W``, the
  bias too); nothing is left for a reader to do;
- ``input`` / ``output``: *online*, applied by the reader to the activation (``x T`` / ``y T``)
  with the matrix the checkpoint stores as ``<module>.<group>_<location>.weight``;
- ``q_attn`` / ``k_cache``: the queries and the keys after RoPE (SpinQuant's R3).

``T`` is the stored matrix ``S``, transposed when ``inverse``; ``hadamard`` and
``random-hadamard`` store ``S`` with +-1 entries and divide by ``sqrt(len(S))``; a
``random-matrix`` stores ``T`` itself (already inverted where ``inverse``). A matrix smaller than
the features acts block-diagonally (``head_dim``). One matrix serves every module of its size in a
group, so a checkpoint stores it once (under the first module's name) and the other modules share
it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmpress.errors import CheckpointError

__all__ = ["ONLINE", "TransformArgs", "TransformConfig", "TransformScheme", "describe_transforms", "read_transform_config"]

Location = Literal["input", "weight_input", "weight_output", "output", "k_cache", "q_attn"]
#: where the reader applies the matrix at run time (the rest are folded into the weights)
ONLINE = ("input", "output", "k_cache", "q_attn")
KINDS = ("hadamard", "random-hadamard", "random-matrix")


class TransformArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    targets: list[str]
    location: Location
    inverse: bool = False
    ignore: list[str] = Field(default_factory=list)

    @field_validator("targets", "ignore", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def online(self) -> bool:
        return self.location in ONLINE


class TransformScheme(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    apply: list[TransformArgs] = Field(default_factory=list)
    randomize: bool = False
    requires_grad: bool = False
    head_dim: int | None = None
    precision: str = "torch.float32"


class TransformConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config_groups: dict[str, TransformScheme]

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def online(self) -> list[tuple[str, TransformScheme, TransformArgs]]:
        """Every (group, scheme, entry) a reader applies at run time."""
        return [(name, scheme, args) for name, scheme in self.config_groups.items() for args in scheme.apply if args.online]


def read_transform_config(data: Any) -> TransformConfig | None:
    """A checkpoint's ``transform_config`` (None when it has none), or a ``CheckpointError``
    that says what in it cannot be read."""
    if not data:
        return None
    try:
        config = TransformConfig.model_validate(data)
    except ValueError as exc:
        raise CheckpointError("the checkpoint's transform_config is not one llmpress can read", got=str(exc).splitlines()[0],
                              expected="compressed-tensors' TransformConfig (config_groups of type, apply, head_dim...)") from None
    for name, scheme in config.config_groups.items():
        if scheme.type not in KINDS:
            raise CheckpointError(f"transform group {name!r} is of a type llmpress cannot apply", got=scheme.type,
                                  expected=" / ".join(KINDS))
    return config


def describe_transforms(data: Any) -> list[str]:
    """One line per group of a ``transform_config`` (JSON), for ``llmpress inspect``."""
    config = read_transform_config(data)
    if config is None:
        return []
    lines = []
    for name, scheme in config.config_groups.items():
        parts = [f"{a.location}{' (inverse)' if a.inverse else ''} of {', '.join(a.targets)}" for a in scheme.apply]
        online = any(a.online for a in scheme.apply)
        block = f", blocks of {scheme.head_dim}" if scheme.head_dim else ""
        where = ("at run time: llmpress.load applies it; vLLM's CPU build 0.32 refuses it; transformers + compressed-tensors ignore it" if online
                 else "folded into the weights: every reader computes it")
        lines.append(f"rotation {name} ({scheme.type}{block}): {'; '.join(parts)} -- {where}")
    return lines
