"""Orthogonal rotations for the residual stream and the attention heads: Hadamard matrices of any
order that has one we can build, applied in ``O(n log n)``, and seeded random ones.

A Hadamard matrix ``H`` (entries +-1, ``H Hᵀ = n I``) scaled by ``1/sqrt(n)`` is orthogonal
and spreads every channel over all of them, which is what takes the outliers out of what a
quantizer sees (QuaRot, SpinQuant). Orders built here:

- ``2^k`` (Sylvester), applied as ``k`` butterfly steps;
- ``m 2^k`` where ``m = p + 1`` for a prime ``p = 3 (mod 4)`` (Paley I: 12, 20, 24, 44, 60...)
  or ``m = 2 (p + 1)`` for a prime ``p = 1 (mod 4)`` (Paley II: 12, 28, 36, 60, 76...), as
  ``A ⊗ H_{2^k}``: one small product with ``A``, then the butterflies. SmolLM2's 576 is
  ``36 x 16``, its MLP's 1536 ``12 x 128``, Llama-3's 14336 ``28 x 512``.

``Rotation.kind``: ``hadamard`` (deterministic), ``random-hadamard`` (``diag(±1) H``, the signs
from ``seed``), ``random-matrix`` (a seeded random orthogonal matrix, by QR; any size). A size
no Hadamard construction reaches is an error that says so, unless ``block`` names a size that
divides it (a block-diagonal rotation, ``transform_block_size``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from llmpress.errors import RecipeError

__all__ = ["Rotation", "hadamard_factor", "hadamard_matrix"]

Kind = Literal["hadamard", "random-hadamard", "random-matrix"]


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, math.isqrt(p) + 1))


def _jacobsthal(p: int) -> torch.Tensor:
    """``Q[i, j] = χ(j - i)``, χ the quadratic character modulo the prime ``p``."""
    squares = {(x * x) % p for x in range(1, p)}
    chi = torch.tensor([0] + [1 if d in squares else -1 for d in range(1, p)], dtype=torch.float64)
    index = (torch.arange(p)[None, :] - torch.arange(p)[:, None]) % p
    return chi[index]


@functools.lru_cache(maxsize=None)
def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``m`` by Paley's constructions, or None."""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:  # Paley I
        p = m - 1
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0] = 1.0, -1.0
        s[1:, 1:] = _jacobsthal(p)
        return torch.eye(m, dtype=torch.float64) + s
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:  # Paley II
        p = m // 2 - 1
        c = torch.zeros(p + 1, p + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0] = 1.0, 1.0
        c[1:, 1:] = _jacobsthal(p)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(p + 1, dtype=torch.float64), minus)
    return None


def hadamard_factor(n: int) -> tuple[torch.Tensor, int] | None:
    """``(A, k)`` with ``n = len(A) 2^k`` and ``A`` a Hadamard matrix (``[[1.]]`` for a power of
    two), the smallest ``A`` that works; None when no construction here reaches ``n``."""
    k = (n & -n).bit_length() - 1 if n > 0 else 0
    for twos in range(k, -1, -1):  # the most butterflies, the smallest A
        m = n >> twos
        if m == 1:
            return torch.ones(1, 1, dtype=torch.float64), twos
        a = _paley(m)
        if a is not None:
            return a, twos
    return None


def hadamard_matrix(n: int) -> torch.Tensor:
    """The ``n x n`` Hadamard matrix this module uses (+-1 entries, float64), for checks."""
    return _hadamard_rows(torch.eye(n, dtype=torch.float64), _factor_or_raise(n))


def _factor_or_raise(n: int) -> tuple[torch.Tensor, int]:
    found = hadamard_factor(n)
    if found is None:
        raise RecipeError(
            f"no Hadamard matrix of order {n} can be built here",
            got=f"size {n}",
            expected="2^k, or 2^k times p + 1 (a prime p = 3 mod 4) or 2 (p + 1) (a prime p = 1 mod 4)",
            fix="set transform_block_size to a size of that form that divides it (a block-diagonal rotation), "
                "or transform_type: random-matrix",
        )
    return found


def _butterflies(x: torch.Tensor, twos: int) -> torch.Tensor:
    """``x @ H_{2^k}`` over the last dimension (Sylvester's order), unnormalised. Without autograd
    the passes go back and forth between two buffers (4x faster in float64 than a new tensor per
    sum, difference and stack; the same bits)."""
    if x.requires_grad and torch.is_grad_enabled():
        for step in range(twos):
            h = 1 << step
            pairs = x.unflatten(-1, (-1, 2, h))
            x = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2).flatten(-3)
        return x
    buffers = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(min(twos, 2))]
    for step in range(twos):
        h = 1 << step
        target = buffers[step % 2]
        first, second = x.unflatten(-1, (-1, 2, h)).unbind(-2)
        low, high = target.unflatten(-1, (-1, 2, h)).unbind(-2)
        torch.add(first, second, out=low)
        torch.sub(first, second, out=high)
        x = target
    return x


def _hadamard_rows(x: torch.Tensor, factor: tuple[torch.Tensor, int], transpose: bool = False) -> torch.Tensor:
    """``x @ (A ⊗ H_{2^k})`` (or its transpose) over the last dimension, unnormalised: with ``X``
    the row as an ``m x 2^k`` matrix, ``Aᵀ X H`` (``A X H``)."""
    a, twos = factor
    blocks = _butterflies(x.unflatten(-1, (a.shape[0], 1 << twos)), twos)
    if a.shape[0] > 1:
        blocks = torch.einsum("ia,...ij->...aj" if not transpose else "ai,...ij->...aj", a.to(x.device, x.dtype), blocks)
    return blocks.flatten(-2)


@dataclass
class Rotation:
    """An orthogonal ``n x n`` matrix ``Q``, applied to rows: ``rows(x) = x Q``, ``rows(x, True) =
    x Qᵀ``. ``block``: ``Q`` is block-diagonal with blocks of that size."""

    size: int
    kind: Kind = "hadamard"
    seed: int = 0
    block: int | None = None
    _factor: tuple[torch.Tensor, int] | None = field(default=None, init=False, repr=False)
    _signs: torch.Tensor | None = field(default=None, init=False, repr=False)
    _dense: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        width = self.block or self.size
        if self.size % width:
            raise RecipeError(f"transform_block_size {width} does not divide the rotated size {self.size}",
                              got=str(width), expected=f"a divisor of {self.size}")
        generator = torch.Generator().manual_seed(self.seed)
        if self.kind == "random-matrix":
            gaussian = torch.randn(width, width, generator=generator, dtype=torch.float64)
            q, r = torch.linalg.qr(gaussian)
            self._dense = q * torch.sign(torch.diagonal(r))[None, :]  # Haar-distributed
        else:
            self._factor = _factor_or_raise(width)
            if self.kind == "random-hadamard":
                self._signs = torch.randint(0, 2, (width,), generator=generator).to(torch.float64) * 2 - 1

    @property
    def width(self) -> int:
        return self.block or self.size

    def matrix(self) -> torch.Tensor:
        """``Q`` itself (float64), for checks."""
        return self.rows(torch.eye(self.size, dtype=torch.float64))

    def rows(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``x Q`` (``x Qᵀ`` with ``transpose``) over the last dimension, in ``x``'s dtype."""
        if x.shape[-1] != self.size:
            raise ValueError(f"rows of {x.shape[-1]} values cannot take a rotation of size {self.size}")
        blocks = x.unflatten(-1, (-1, self.width))
        if self._dense is not None:
            q = self._dense.to(x.device, x.dtype)
            out = blocks @ (q.T if transpose else q)
        else:
            scale = 1.0 / math.sqrt(self.width)
            signs = self._signs.to(x.device, x.dtype) if self._signs is not None else None
            if signs is not None and not transpose:
                blocks = blocks * signs
            out = _hadamard_rows(blocks, self._factor, transpose) * scale
            if signs is not None and transpose:
                out = out * signs
        return out.flatten(-2)
