"""The rotations a model applies to activations at run time (``input`` / ``output`` entries of a
``transform_config``): an ``OnlineTransform`` child of the Linear it acts on, named
``<group>_<location>`` as compressed-tensors names it (so the checkpoint's tensor is
``<module>.<group>_<location>.weight``), and a hook that calls it.

The product runs in float32 (in the activation's dtype when that is wider): a rotation's
entries are +-1 / sqrt(n), and float32 keeps the rotated activations within 1e-6 of
compressed-tensors' float64.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmpress.errors import CheckpointError

__all__ = ["OnlineTransform", "SharedMatrix", "attach", "drop_repeated_matrices", "online_transforms", "written_transform_config"]


class SharedMatrix:
    """``T`` of one stored matrix, made once per dtype and device and shared by every module that
    reads that matrix (30 ``down_proj`` of SmolLM2 hold one 1536 x 1536 ``T``, not 30). Not a
    buffer: a model cast to bf16 would cast it (and copy it per module), where ``T`` stays in
    float32. The stored matrix is read when ``T`` is first needed in a dtype and device: it is
    fixed once attached (a checkpoint's, or the one a modifier made)."""

    def __init__(self) -> None:
        self.made: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, transform: OnlineTransform, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self.made:
            self.made[key] = transform.matrix(dtype).to(device)
        return self.made[key]


class OnlineTransform(nn.Module):
    """``value @ T`` over the last dimension, block-diagonal when ``T`` is smaller. ``weight`` is
    the stored matrix ``S`` (shared by every module of its size in its group); ``T = S / sqrt(n)``
    (``Sᵀ / sqrt(n)`` when ``inverse``) for the Hadamard kinds, ``T = S`` for ``random-matrix``.
    ``shared``: the ``SharedMatrix`` of another module of the same stored matrix and direction."""

    def __init__(self, weight: torch.Tensor, kind: str, location: str, inverse: bool, perm: torch.Tensor | None = None,
                 shared: SharedMatrix | None = None) -> None:
        super().__init__()
        self.kind, self.location, self.inverse = kind, location, inverse
        self.register_buffer("weight", weight)
        self.perm: torch.Tensor | None
        self.register_buffer("perm", perm)
        self.shared = shared if shared is not None else SharedMatrix()

    def matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """``T`` in ``dtype``, from the stored matrix."""
        s = self.weight
        if self.perm is not None:
            s = s[self.perm][:, self.perm]
        if self.kind == "random-matrix":
            return s.to(dtype)
        s = s.T if self.inverse else s
        return s.to(dtype) / math.sqrt(s.shape[0])

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        dtype = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
        t = self.shared.get(self, dtype, value.device)
        n = t.shape[0]
        if value.shape[-1] % n:
            raise CheckpointError(f"a {self.location} rotation of size {n} cannot act on {value.shape[-1]} features",
                                  got=f"{value.shape[-1]} features", expected=f"a multiple of {n}")
        out = value.to(dtype).unflatten(-1, (-1, n)) @ t
        return out.flatten(-2).to(value.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.location}, size {self.weight.shape[0]}{', inverse' if self.inverse else ''}"


class _OnInput:
    """A forward pre-hook: the module's first argument through its child ``name``. It stays
    first among the module's pre-hooks (``runs_first``: a calibration observer registered later
    goes after it), so every observer sees the rotated input the weights multiply."""

    runs_first = True

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple):
        return (getattr(module, self.name)(args[0]), *args[1:])


class _OnOutput:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return getattr(module, self.name)(output)


def attach(module: nn.Module, name: str, transform: OnlineTransform) -> None:
    """``module`` applies ``transform`` to its input (before any other pre-hook: what a
    quantizer observes is the rotated input) or its output, as ``transform.location`` says."""
    if hasattr(module, name):
        raise CheckpointError(f"the module already has a {name!r} rotation", got=name, expected="one rotation per group and location")
    module.add_module(name, transform)
    if transform.location == "input":
        module.register_forward_pre_hook(_OnInput(name), prepend=True)
    elif transform.location == "output":
        module.register_forward_hook(_OnOutput(name))
    else:
        raise ValueError(f"an online transform of a Linear acts on its input or output, not {transform.location!r}")


def online_transforms(model: nn.Module) -> list[tuple[str, OnlineTransform]]:
    """Every online rotation of ``model``, by its full name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OnlineTransform)]


def drop_repeated_matrices(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Keep each online rotation's matrix once in a state dict about to be saved: the first
    module's, as compressed-tensors writes it (the others share it when they read it back).
    Blocks the pipeline moved between devices hold equal copies, so equality decides, not
    identity. Returns how many tensors were dropped."""
    kept: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}
    dropped = 0
    for name, _ in online_transforms(model):
        leaf = name.rpartition(".")[2]
        for local in ("weight", "perm"):
            key = f"{name}.{local}"
            tensor = state.get(key)
            if tensor is None:
                continue
            same = kept.setdefault((f"{leaf}.{local}", tuple(tensor.shape)), [])
            if any(t.dtype == tensor.dtype and torch.equal(t, tensor) for t in same):
                del state[key]
                dropped += 1
            else:
                same.append(tensor)
    return dropped


def written_transform_config(model: nn.Module, config: dict) -> dict:
    """``config`` as the checkpoint says it: a ``hadamard`` group whose run-time matrices are not
    all of an order 2^k is written ``random-hadamard``. Both mean "the stored +-1 matrix over
    sqrt(n)", but a reader may compute a ``hadamard`` one itself instead of reading it (vLLM's
    hadacore kernel on a GPU builds Sylvester's, which exists for 2^k only), and llmpress's
    other orders (Paley's: SmolLM2's 1536 = 12 x 128) are not that matrix."""
    sizes: dict[str, set[int]] = {}
    for name, module in online_transforms(model):
        sizes.setdefault(name.rpartition(".")[2].rpartition("_")[0], set()).add(module.weight.shape[0])
    groups = {}
    for group, scheme in config["config_groups"].items():
        if scheme.get("type") == "hadamard" and any(n & (n - 1) for n in sizes.get(group, ())):
            scheme = {**scheme, "type": "random-hadamard"}
        groups[group] = scheme
    return {**config, "config_groups": groups}
