"""The inverse-Hessian factor GPTQ needs, computed in place in the Hessian's own memory.

GPTQ wants the upper Cholesky factor ``U`` of ``(H + damp * I)^-1`` (``H^-1 = U^T U``). With ``J``
the order-reversing permutation and ``J H J = L L^T``: ``H^-1 = (J L^-1 J)^T (J L^-1 J)``, and
``J L^-1 J`` is upper triangular. So one Cholesky and one triangular inverse suffice (instead of
Cholesky, inverse, and a second Cholesky of the inverse: half the time), and the result can live
in the buffer that held ``H``: ``J H J`` is ``H`` with its flat storage reversed, the factor is
factored in place, the triangular inverse goes block by block, and ``J . J`` is one more reversal.

The Cholesky is our own, blocked (``_cholesky_in_place``): it writes only the lower triangle, so
the strict upper triangle still holds the Hessian when a factorization fails, and a retry with
more dampening mirrors it back. (LAPACK through torch needs a second matrix for that: its output
zeroes the other triangle.) For a down_proj-sized Hessian (2816 inputs) this keeps three 32 MB
copies out of the peak; for Llama-8B's (14336 inputs), three of 820 MB.
"""

from __future__ import annotations

import logging
import math

import torch

from llmpress.errors import UnsupportedModelError

__all__ = ["MAX_DAMPENING_RETRIES", "inverse_hessian_factor", "permute_rows_"]

logger = logging.getLogger(__name__)

MAX_DAMPENING_RETRIES = 6
_TRIANGULAR_LEAF = 256
_REVERSE_CHUNK = 1 << 18


def permute_rows_(matrix: torch.Tensor, perm: torch.Tensor, columns_too: bool = False) -> torch.Tensor:
    """``matrix[perm]`` (``columns_too``: ``matrix[perm][:, perm]``, a square matrix) in
    ``matrix``'s own memory, with one row of scratch: the rows move along the permutation's
    cycles. Activation order permutes GPTQ's Hessian and weight this way; ``H[perm][:, perm]``
    held two more Hessians at once (for Llama-8B's down_proj, 1.6 GB)."""
    order = perm.tolist()
    scratch = torch.empty_like(matrix[0])
    done = bytearray(len(order))

    def put(row: int, source: torch.Tensor) -> None:
        if columns_too:
            torch.index_select(source, 0, perm, out=matrix[row])
        else:
            matrix[row].copy_(source)

    for start in range(len(order)):
        if done[start]:
            continue
        scratch.copy_(matrix[start])  # the cycle's first row, overwritten first
        row = start
        while True:
            done[row] = 1
            source = order[row]
            if source == start:
                put(row, scratch)
                break
            put(row, matrix[source])
            row = source
    return matrix


def _reverse_in_place(matrix: torch.Tensor) -> None:
    """``matrix`` becomes ``matrix.flip(0, 1)`` (for a square matrix, its flat storage
    reversed), through temporaries of at most ``_REVERSE_CHUNK`` elements."""
    flat = matrix.view(-1)
    total = flat.numel()
    for start in range(0, total // 2, _REVERSE_CHUNK):
        size = min(_REVERSE_CHUNK, total // 2 - start)
        low, high = flat[start : start + size], flat[total - start - size : total - start]
        saved = low.clone()
        low.copy_(high.flip(0))
        high.copy_(saved.flip(0))


def _invert_lower_in_place(lower: torch.Tensor) -> None:
    """``lower`` (a view; only its lower triangle is read) becomes ``L^-1``, zeros above the
    diagonal. By halves: ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``; the
    off-diagonal block is two matrix products, twice as fast as a triangular solve against the
    identity at these sizes."""
    n = lower.shape[0]
    if n <= _TRIANGULAR_LEAF:
        identity = torch.eye(n, dtype=lower.dtype, device=lower.device)
        lower.copy_(torch.linalg.solve_triangular(lower, identity, upper=False))
        return
    half = n // 2
    _invert_lower_in_place(lower[:half, :half])
    _invert_lower_in_place(lower[half:, half:])
    lower[:half, half:].zero_()
    corner = lower[half:, :half]
    corner.copy_(lower[half:, half:] @ (corner @ lower[:half, :half])).neg_()


def _cholesky_in_place(matrix: torch.Tensor) -> bool:
    """``matrix``'s lower triangle (diagonal included) becomes ``L`` with ``matrix = L L^T``,
    block column by block column (left-looking: a block column is read as the Hessian, updated
    by the finished ones and factored). Only the lower triangle is read or written; the strict
    upper triangle is left as it was. False, with the lower triangle partly overwritten, when
    the matrix is not positive definite."""
    n = matrix.shape[0]
    for start in range(0, n, _TRIANGULAR_LEAF):
        end = min(start + _TRIANGULAR_LEAF, n)
        done = matrix[start:, :start]  # rows start.., finished columns: L
        diagonal = torch.tril(matrix[start:end, start:end])
        diagonal = diagonal + torch.tril(diagonal, -1).t()
        if start:
            diagonal.sub_(done[: end - start] @ done[: end - start].t())
        factor, info = torch.linalg.cholesky_ex(diagonal)
        if int(info) != 0 or not bool(torch.isfinite(factor.diagonal().reciprocal()).all()):
            return False
        if end < n:
            below = matrix[end:, start:end]
            if start:
                below.sub_(done[end - start :] @ done[: end - start].t())
            below.copy_(torch.linalg.solve_triangular(factor.t(), below, upper=True, left=False))  # below @ L^-T
        block = matrix[start:end, start:end]
        block.copy_(torch.triu(block, 1).add_(factor))
    return True


def _mirror_upper_in_place(matrix: torch.Tensor) -> None:
    """The strict lower triangle becomes the transpose of the strict upper one, a block column
    at a time (temporaries of one block)."""
    n = matrix.shape[0]
    for start in range(0, n, _TRIANGULAR_LEAF):
        end = min(start + _TRIANGULAR_LEAF, n)
        block = matrix[start:end, start:end]
        block.copy_(torch.triu(block) + torch.triu(block, 1).t())
        if end < n:
            matrix[end:, start:end].copy_(matrix[start:end, end:].t())


def inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float, *, overwrite: bool = False) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * I)^-1`` and the dampening fraction used; retries
    with 10x more dampening (up to ``MAX_DAMPENING_RETRIES`` times) instead of failing on a
    Hessian that is not positive definite. With ``overwrite`` the factor is computed in (and
    returned as) ``hessian``'s own memory, which the caller gives up."""
    work = hessian if overwrite else hessian.clone()
    diagonal = work.diagonal().clone()
    mean_diag = float(diagonal.mean())
    _reverse_in_place(work)
    diagonal = diagonal.flip(0)
    frac = dampening_frac
    for attempt in range(MAX_DAMPENING_RETRIES + 1):
        work.diagonal().add_(frac * mean_diag)
        if _cholesky_in_place(work):
            _invert_lower_in_place(work)
            if all(math.isfinite(float(v)) for v in torch.aminmax(work)):  # no inf or nan; a reduction, no n^2 temporaries
                _reverse_in_place(work)
                return work, frac
            break  # the inverse overflowed; the Hessian is gone, so this cannot be retried
        _mirror_upper_in_place(work)  # the Hessian back from its untouched upper triangle
        work.diagonal().copy_(diagonal)
        if attempt == MAX_DAMPENING_RETRIES:
            break
        retry = max(frac * 10, 1e-3)
        logger.warning("GPTQ: Hessian not positive definite with dampening %.3g; retrying with %.3g", frac, retry)
        frac = retry
    raise UnsupportedModelError(
        "GPTQ could not invert the Hessian even with strong dampening",
        got=f"dampening_frac up to {frac:.3g}",
        expected="a positive definite Hessian",
        fix="use more or more varied calibration samples, or raise dampening_frac",
    )
