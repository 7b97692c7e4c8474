"""Apply a ``transform_config`` to a model's Linears with llmpress's rotations
(``hadamard.py``): the ``weight_*`` entries are folded into the weights in
float64, the ``input`` / ``output`` entries become ``OnlineTransform`` children that the model runs
(and a quantizer calibrating after it observes), and the config is recorded on the model for the
checkpoint. What QuIP and SpinQuant's R4 do (``modifiers/rotation/``).

Every module of one size in a group gets the same matrix (compressed-tensors' ``randomize:
false``), so the checkpoint stores it once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from llmpress.errors import RecipeError, UnsupportedModelError
from llmpress.lifecycle.records import record_transform_group
from llmpress.models.linear import input_major, is_linear
from llmpress.targets import matches
from llmpress.transforms.config import TransformArgs, TransformScheme
from llmpress.transforms.hadamard import Rotation
from llmpress.transforms.online import OnlineTransform, attach

__all__ = ["GroupMatrices", "apply_group"]


class GroupMatrices:
    """One group's rotations: ``Q`` per block width (seeded), and the stored matrices of its
    online entries, shared by every module of their size."""

    def __init__(self, scheme: TransformScheme, seed: int) -> None:
        self.scheme, self.seed = scheme, seed
        self._rotations: dict[int, torch.Tensor] = {}
        self._stored: dict[tuple[str, int], torch.Tensor] = {}
        self._made: dict[tuple[str, int], OnlineTransform] = {}

    def width(self, features: int) -> int:
        width = self.scheme.head_dim or features
        if features % width:
            raise RecipeError(f"transform block size {width} does not divide {features} features",
                              got=str(width), expected=f"a divisor of {features}", fix="set transform_block_size to one")
        return width

    def rotation(self, width: int) -> torch.Tensor:
        """``Q`` (``width x width``, float64, orthogonal)."""
        if width not in self._rotations:
            self._rotations[width] = Rotation(width, self.scheme.type, self.seed).matrix()
        return self._rotations[width]

    def stored(self, location: str, width: int) -> torch.Tensor:
        """The matrix the checkpoint keeps for an online entry: ``Q sqrt(n)`` (+-1 entries) for
        the Hadamard kinds, ``Q`` for a random matrix (orthogonal: its inverse is ``Qᵀ``)."""
        key = (location, width)
        if key not in self._stored:
            q = self.rotation(width)
            matrix = q if self.scheme.type == "random-matrix" else (q * math.sqrt(width)).round()
            self._stored[key] = matrix.to(torch.float32)
        return self._stored[key]


    def online(self, args: TransformArgs, width: int, device: torch.device) -> OnlineTransform:
        """The online rotation of an entry, sharing its matrices with the modules before it."""
        key = (args.location, width)
        first = self._made.get(key)
        if first is not None and first.weight.device == device:
            return OnlineTransform(first.weight, first.kind, first.location, first.inverse, shared=first.shared)
        made = OnlineTransform(self.stored(args.location, width).to(device), self.scheme.type, args.location, args.inverse)
        self._made.setdefault(key, made)
        return made


def _blocks(matrix: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``matrix @ blockdiag(t, t, ...)`` over its last dimension."""
    n = t.shape[0]
    return (matrix.unflatten(-1, (-1, n)) @ t).flatten(-2)


@torch.no_grad()
def _apply_entry(module: nn.Module, name: str, group: str, args: TransformArgs, matrices: GroupMatrices) -> None:
    if not is_linear(module) or input_major(module):
        raise UnsupportedModelError(f"rotation group {group!r} targets {name!r}, which is not an nn.Linear",
                                    got=type(module).__name__, expected="nn.Linear (GPT-2's Conv1D is not supported)",
                                    fix=f"add {name!r} to the modifier's ignore")
    inputs = args.location in ("input", "weight_input")
    width = matrices.width(module.in_features if inputs else module.out_features)
    q = matrices.rotation(width)
    t = q.T if args.inverse else q  # T
    if args.location == "weight_input":  # W Tᵀ
        weight = module.weight.detach().double()
        module.weight.data = _blocks(weight, t.T.to(weight.device)).to(module.weight.dtype).contiguous()
    elif args.location == "weight_output":  # Tᵀ W, Tᵀ b
        weight = module.weight.detach().double()
        module.weight.data = _blocks(weight.T, t.to(weight.device)).T.to(module.weight.dtype).contiguous()
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            module.bias.data = _blocks(module.bias.detach().double(), t.to(weight.device)).to(module.bias.dtype)
    elif args.location in ("input", "output"):
        # a finished layer a resumed run restored holds its weight as integers (a meta float weight):
        # its matrix goes to the host, and T to the activations' device when first used
        device = torch.device("cpu") if module.weight.is_meta else module.weight.device
        attach(module, f"{group}_{args.location}", matrices.online(args, width, device))
    else:
        raise RecipeError(f"rotation group {group!r}: {args.location} rotations (of the queries and keys) are not built",
                          got=args.location, expected="input, output, weight_input or weight_output")


def apply_group(group: str, scheme: TransformScheme, modules: Iterable[tuple[str, nn.Module]], matrices: GroupMatrices,
                model: nn.Module | None = None, online_only: bool = False) -> int:
    """Apply ``scheme``'s entries to those of ``modules`` (full names) they target; with
    ``model``, record the group there for the checkpoint. Returns how many entries were applied.
    Entries are applied in their order, so one module's weight and online parts agree.
    ``online_only``: the run-time entries alone (a block a resumed run restored was saved with
    its weights rotated)."""
    count = 0
    modules = list(modules)
    for args in scheme.apply:
        if online_only and not args.online:
            continue
        for name, module in modules:
            if matches(name, module, args.targets, linear_alias=True) and not matches(name, module, args.ignore, linear_alias=True):
                _apply_entry(module, name, group, args, matrices)
                count += 1
    if model is not None:
        record_transform_group(model, group, scheme)
    return count
