"""The inverse-Hessian factor GPTQ needs, computed in place in the Hessian's own memory.

GPTQ wants the upper Cholesky factor ``U`` of ``(H + damp * I)^-1`` (``H^-1 = U^T U``). With ``J``
the order-reversing permutation and ``J H J = L L^T``: ``H^-1 = (J L^-1 J)^T (J L^-1 J)``, and
``J L^-1 J`` is upper triangular. So one Cholesky and one triangular inverse suffice (instead of
Cholesky, inverse, and a second Cholesky of the inverse: half the time), and the result can live
in the buffer that held ``H``: ``J H J`` is ``H`` with its flat storage reversed, the factor is
copied over it, the triangular inverse goes block by block, and ``J . J`` is one more reversal.
For a down_proj-sized Hessian (2816 inputs) that keeps two 32 MB copies out of the peak.
"""

from __future__ import annotations

import logging

import torch

from llmpress.errors import UnsupportedModelError

__all__ = ["MAX_DAMPENING_RETRIES", "inverse_hessian_factor"]

logger = logging.getLogger(__name__)

MAX_DAMPENING_RETRIES = 6
_TRIANGULAR_LEAF = 256
_REVERSE_CHUNK = 1 << 20


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
        # out of place: a failed factorization leaves the Hessian as it was (LAPACK's in-place
        # variant clears the upper triangle even when it fails); copied over it on success
        factor, info = torch.linalg.cholesky_ex(work)
        work.diagonal().copy_(diagonal)
        if int(info) == 0 and bool(torch.isfinite(factor.diagonal().reciprocal()).all()):
            work.copy_(factor)
            del factor
            _invert_lower_in_place(work)
            if bool(torch.isfinite(work).all()):
                _reverse_in_place(work)
                return work, frac
            break  # the inverse overflowed; the Hessian is gone, so this cannot be retried
        del factor
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
