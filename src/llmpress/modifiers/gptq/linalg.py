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

from llmpress import native
from llmpress.errors import UnsupportedModelError
from llmpress.parallel.node import ALONE, Team

__all__ = ["MAX_DAMPENING_RETRIES", "inverse_hessian_factor", "permute_rows_"]

logger = logging.getLogger(__name__)

MAX_DAMPENING_RETRIES = 6
_TRIANGULAR_LEAF = 256
_REVERSE_CHUNK = 1 << 18


def permute_rows_(matrix: torch.Tensor, perm: torch.Tensor, columns_too: bool = False, team: Team = ALONE) -> torch.Tensor:
    """``matrix[perm]`` (``columns_too``: ``matrix[perm][:, perm]``, a square matrix) in
    ``matrix``'s own memory, with one row of scratch: the rows move along the permutation's
    cycles. Activation order permutes GPTQ's Hessian and weight this way; ``H[perm][:, perm]``
    held two more Hessians at once (for Llama-8B's down_proj, 1.6 GB). A ``team`` sharing
    ``matrix`` permutes each row's columns by row panels, then moves the rows, each member its
    share of the cycles (the same values: only moved)."""
    if team is not ALONE:
        if columns_too:
            for index, (a, b) in enumerate(_panels(0, matrix.shape[0], matrix.device)):
                if team.mine(index):
                    matrix[a:b].copy_(torch.index_select(matrix[a:b], 1, perm))
            team.sync()
        for index, cycle in enumerate(_cycles(perm.tolist())):
            if team.mine(index):
                _rotate_rows(matrix, cycle)
        team.sync()
        return matrix
    if native.permute_rows_(matrix, perm, columns_too):  # the same moves, without a call per row
        return matrix
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


def _cycles(order: list[int]) -> list[list[int]]:
    """The cycles (of two rows or more) of the permutation ``row <- order[row]``."""
    done = bytearray(len(order))
    found = []
    for start in range(len(order)):
        if done[start] or order[start] == start:
            continue
        cycle, row = [], start
        while not done[row]:
            done[row] = 1
            cycle.append(row)
            row = order[row]
        found.append(cycle)
    return found


def _rotate_rows(matrix: torch.Tensor, cycle: list[int]) -> None:
    """Row ``cycle[i]`` takes row ``cycle[i + 1]``'s values, the last row the first's."""
    first = matrix[cycle[0]].clone()
    for row, source in zip(cycle, cycle[1:]):
        matrix[row].copy_(matrix[source])
    matrix[cycle[-1]].copy_(first)


def _reverse_in_place(matrix: torch.Tensor, team: Team = ALONE) -> None:
    """``matrix`` becomes ``matrix.flip(0, 1)`` (for a square matrix, its flat storage
    reversed), through temporaries of at most ``_REVERSE_CHUNK`` elements; ``team``'s members
    swap their share of the chunk pairs."""
    flat = matrix.view(-1)
    total = flat.numel()
    for index, start in enumerate(range(0, total // 2, _REVERSE_CHUNK)):
        if not team.mine(index):
            continue
        size = min(_REVERSE_CHUNK, total // 2 - start)
        low, high = flat[start : start + size], flat[total - start - size : total - start]
        saved = low.clone()
        low.copy_(high.flip(0))
        high.copy_(saved.flip(0))
    team.sync()


def _panels(start: int, end: int, device: torch.device) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` in panels of ``_TRIANGULAR_LEAF`` on the CPU: the unit of work of the
    factor's products. Every product is taken panel by panel however many processes share them,
    so a shared factor is the bits of one computed alone (a row slice of a BLAS product does not
    always round as the whole product does). On a GPU, where no team shares the factor and each
    kernel launch costs more than a panel's work, one panel."""
    if device.type != "cpu":
        return [(start, end)] if start < end else []
    return [(a, min(a + _TRIANGULAR_LEAF, end)) for a in range(start, end, _TRIANGULAR_LEAF)]


def _inverse_nodes(offset: int, size: int, depth: int, found: list[tuple[int, int, int]]) -> None:
    """The halving of ``_invert_lower_in_place``: ``(depth, offset, size)`` of every block."""
    found.append((depth, offset, size))
    if size > _TRIANGULAR_LEAF:
        half = size // 2
        _inverse_nodes(offset, half, depth + 1, found)
        _inverse_nodes(offset + half, size - half, depth + 1, found)


def _invert_lower_in_place(lower: torch.Tensor, team: Team = ALONE) -> None:
    """``lower`` (only its lower triangle is read) becomes ``L^-1``, zeros above the diagonal. By
    halves: ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``; the off-diagonal block
    is two matrix products, twice as fast as a triangular solve against the identity at these
    sizes. The halving's leaves are inverted first, then its blocks from the smallest up, each
    block's products panel by panel: ``T = C A^-1`` goes, transposed, to the block's upper right
    (which ends as zeros), then ``-B^-1 T`` to ``C``'s place."""
    nodes: list[tuple[int, int, int]] = []
    _inverse_nodes(0, lower.shape[0], 0, nodes)
    leaves = [(o, n) for _, o, n in nodes if n <= _TRIANGULAR_LEAF]
    for index, (o, n) in enumerate(leaves):
        if team.mine(index):
            block = lower[o : o + n, o : o + n]
            identity = torch.eye(n, dtype=lower.dtype, device=lower.device)
            block.copy_(torch.linalg.solve_triangular(block, identity, upper=False))
    team.sync()
    inner = [node for node in nodes if node[2] > _TRIANGULAR_LEAF]
    for depth in sorted({d for d, _, _ in inner}, reverse=True):
        level = [(o, n, n // 2) for d, o, n in inner if d == depth]
        work = [(o, n, h, a, b) for o, n, h in level for a, b in _panels(o + h, o + n, lower.device)]
        for index, (o, n, h, a, b) in enumerate(work):  # T = C A^-1, into the upper right, transposed
            if team.mine(index):
                product = lower[a:b, o : o + h] @ lower[o : o + h, o : o + h]
                lower[o : o + h, a:b].copy_(product.t())
        team.sync()
        for index, (o, n, h, a, b) in enumerate(work):  # C = -B^-1 T, row panels of B^-1
            if team.mine(index):
                inverse_b, scratch = lower[a:b, o + h : o + n], lower[o : o + h, o + h : o + n]
                lower[a:b, o : o + h].copy_(inverse_b @ scratch.t()).neg_()
        team.sync()
        for index, (o, n, h) in enumerate(level):
            if team.mine(index):
                lower[o : o + h, o + h : o + n].zero_()
        team.sync()


def _factor_diagonal(matrix: torch.Tensor, start: int, end: int) -> bool:
    """Block column ``start:end``'s diagonal block, updated by the finished columns (rows
    ``start:end`` of them are final), factored and written into the lower triangle (the strict
    upper one kept); False where it is not positive definite (nothing written)."""
    done = matrix[start:end, :start]
    diagonal = torch.tril(matrix[start:end, start:end])
    diagonal = diagonal + torch.tril(diagonal, -1).t()
    if start:
        diagonal.sub_(done @ done.t())
    factor, info = torch.linalg.cholesky_ex(diagonal)
    if int(info) != 0 or not bool(torch.isfinite(factor.diagonal().reciprocal()).all()):
        return False
    block = matrix[start:end, start:end]
    block.copy_(torch.triu(block, 1).add_(factor))
    return True


def _panel_owners(count: int, size: int, first: int) -> list[int]:
    """The member of ``size`` that takes each of ``count`` panels, the first (which carries the
    next diagonal block, about one panel's work more) to ``first``, the rest to the least loaded."""
    loads = [0] * size
    owners = []
    for index in range(count):
        owner = first if index == 0 else min(range(size), key=lambda r: (loads[r], (r - first) % size))
        loads[owner] += 2 if index == 0 else 1
        owners.append(owner)
    return owners


def _cholesky_in_place(matrix: torch.Tensor, team: Team = ALONE) -> bool:
    """``matrix``'s lower triangle (diagonal included) becomes ``L`` with ``matrix = L L^T``,
    block column by block column (left-looking: a block column is read as the Hessian, updated
    by the finished ones and factored). Only the lower triangle is read or written; the strict
    upper triangle is left as it was. False, with the lower triangle partly overwritten, when
    the matrix is not positive definite.

    Each block column is one step of row panels below its diagonal block, shared by ``team``:
    a panel is updated by the finished columns and solved against the diagonal block's factor;
    the first panel's member then factors the next diagonal block (it holds its rows), so the
    members meet once a step."""
    n = matrix.shape[0]
    if not team.decide(0, _factor_diagonal(matrix, 0, min(_TRIANGULAR_LEAF, n)) if team.mine(0) else True):
        return False
    for step, start in enumerate(range(0, n, _TRIANGULAR_LEAF)):
        end = min(start + _TRIANGULAR_LEAF, n)
        panels = _panels(end, n, matrix.device)
        if not panels:
            break
        owners = _panel_owners(len(panels), team.size, (step + 1) % team.size)
        factor = torch.tril(matrix[start:end, start:end])
        done = matrix[:, :start]  # finished columns: L
        ok = True
        for (a, b), owner in zip(panels, owners, strict=True):
            if owner != team.rank:
                continue
            panel = matrix[a:b, start:end]
            if start:
                panel.sub_(done[a:b] @ done[start:end].t())
            panel.copy_(torch.linalg.solve_triangular(factor.t(), panel, upper=True, left=False))  # panel @ L^-T
            if a == end:
                ok = _factor_diagonal(matrix, end, min(end + _TRIANGULAR_LEAF, n))
        if not team.decide(owners[0], ok):
            return False
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


def inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float, *, overwrite: bool = False,
                           team: Team = ALONE) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * I)^-1`` and the dampening fraction used; retries
    with 10x more dampening (up to ``MAX_DAMPENING_RETRIES`` times) instead of failing on a
    Hessian that is not positive definite. With ``overwrite`` the factor is computed in (and
    returned as) ``hessian``'s own memory, which the caller gives up. ``team``: processes that
    all map ``hessian`` (``parallel/node.py``; with ``overwrite``) and compute the factor in it
    together, every one calling this; the same bits as one process alone."""
    if team is not ALONE and not overwrite:
        raise ValueError("a team factors a Hessian they share in place: pass overwrite=True")
    work = hessian if overwrite else hessian.clone()
    diagonal = work.diagonal().clone()
    mean_diag = float(diagonal.mean())
    team.sync()  # every member has read the diagonal
    _reverse_in_place(work, team)
    diagonal = diagonal.flip(0)
    frac = dampening_frac
    for attempt in range(MAX_DAMPENING_RETRIES + 1):
        if team.mine(0):
            work.diagonal().add_(frac * mean_diag)
        team.sync()
        if _cholesky_in_place(work, team):
            _invert_lower_in_place(work, team)
            finite = all(math.isfinite(float(v)) for v in torch.aminmax(work))  # no inf or nan; a reduction, no n^2 temporaries
            team.sync()  # every member has read it before the reversal writes
            if finite:
                _reverse_in_place(work, team)
                return work, frac
            break  # the inverse overflowed; the Hessian is gone, so this cannot be retried
        if team.mine(0):
            _mirror_upper_in_place(work)  # the Hessian back from its untouched upper triangle
            work.diagonal().copy_(diagonal)
        team.sync()
        if attempt == MAX_DAMPENING_RETRIES:
            break
        retry = max(frac * 10, 1e-3)
        if team.rank == 0:
            logger.warning("GPTQ: Hessian not positive definite with dampening %.3g; retrying with %.3g", frac, retry)
        frac = retry
    raise UnsupportedModelError(
        "GPTQ could not invert the Hessian even with strong dampening",
        got=f"dampening_frac up to {frac:.3g}",
        expected="a positive definite Hessian",
        fix="use more or more varied calibration samples, or raise dampening_frac",
    )
