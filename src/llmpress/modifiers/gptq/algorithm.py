"""The GPTQ update (Frantar et al., 2022) as one pure function on a weight and its Hessian.

Columns are quantized one at a time; each column's rounding error is spread over the columns not
yet quantized through the Cholesky factor of the inverse Hessian, so the layer's output error
``||W X - Q X||`` stays small. Columns go in blocks ("lazy batch"): inside a block updates are
rank-1, and the rest of the matrix gets one matrix product per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmpress import native
from llmpress.errors import SchemeError
from llmpress.modifiers.gptq.linalg import inverse_hessian_factor, permute_rows_
from llmpress.parallel.node import ALONE, Team
from llmpress.quant.observers import on_native_grid, weight_qparams
from llmpress.quant.qdq import expand_to_columns, expand_to_weight, round_to_grid
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["GPTQResult", "HessianFactor", "factor_hessian", "gptq_quantize", "inverse_hessian_factor"]

logger = logging.getLogger(__name__)


@dataclass
class GPTQResult:
    weight: torch.Tensor  # on the quantization grid, float32, as given: [rows, cols] or input-major (possibly a view)
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    loss: float  # sum over entries of (w - q)^2 / d^2: GPTQ's own error measure
    row_loss: torch.Tensor  # the same sum per output row [rows]: a module's share of a stacked solve
    dampening: float  # the dampening fraction that made the Hessian invertible


def _group_args(args: QuantizationArgs) -> QuantizationArgs:
    """The args one group's columns ``[rows, group]`` are observed with: one scale per row
    (NVFP4 keeps its own: one group of that width is one scale per row, against the global scale)."""
    if args.has_global_scale:
        return args
    return args.model_copy(update={"strategy": QuantizationStrategy.CHANNEL, "group_size": None})


def _qparams(weight: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype, global_scale: torch.Tensor | None = None):
    """Observer qparams with the scale rounded to the dtype it will be stored in, so the grid
    GPTQ rounds onto is exactly the one the checkpoint describes."""
    scale, zero_point = weight_qparams(weight, args, global_scale)
    return scale.to(scale_dtype).to(torch.float32), zero_point


def _upfront_qparams(weight: torch.Tensor, args: QuantizationArgs, actorder: bool, scale_dtype: torch.dtype,
                     global_scale: torch.Tensor | None):
    """Scale / zero point fixed before the update starts, or (None, None) when group qparams are
    computed as the update reaches each group (groups without activation ordering)."""
    if args.is_grouped and not actorder:
        return None, None
    return _qparams(weight, args, scale_dtype, global_scale)


def _per_column(scale, zero_point, weight: torch.Tensor, args: QuantizationArgs, perm: torch.Tensor | None):
    """Qparams broadcast to one per column ``[rows, cols]``, in the update's column order."""
    if scale is None:
        return None, None
    cols = weight.shape[1]
    if args.strategy == QuantizationStrategy.BLOCK:
        scale = expand_to_weight(scale, weight.shape, args)
        zero_point = None if zero_point is None else expand_to_weight(zero_point, weight.shape, args)
    scale = expand_to_columns(scale, cols, args).expand(weight.shape[0], cols)
    zero_point = None if zero_point is None else expand_to_columns(zero_point, cols, args).expand(weight.shape[0], cols)
    if perm is not None:
        scale = scale[:, perm]
        zero_point = None if zero_point is None else zero_point[:, perm]
    return scale.contiguous(), None if zero_point is None else zero_point.float().contiguous()


class _Rounding:
    """``w`` rounded onto its grid (a new tensor): one column of the weight, stored as a row,
    or a block of such rows with their scales. The grid's bounds are read from ``args`` once,
    not once per column."""

    def __init__(self, args: QuantizationArgs) -> None:
        self.q_min, self.q_max = args.q_range
        self.args = args

    def __call__(self, w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
        if self.args.is_float:  # fp8, fp4
            return round_to_grid(torch.div(w, scale), self.args).float().mul_(scale)
        q = torch.div(w, scale).round_()
        if zero_point is None:
            return q.clamp_(self.q_min, self.q_max).mul_(scale)
        return q.add_(zero_point).clamp_(self.q_min, self.q_max).sub_(zero_point).mul_(scale)


def _kept_columns(keep: torch.Tensor | Sequence[torch.Tensor], parts: list[torch.Tensor], cols: int, rows: int,
                  input_major: bool) -> torch.Tensor:
    """The parts' keep-masks side by side in the update's layout ``[cols, rows]``."""
    masks = [keep] if isinstance(keep, torch.Tensor) else list(keep)
    KT = torch.empty(cols, rows, dtype=torch.bool, device=parts[0].device)
    offset = 0
    for part, mask in zip(parts, masks, strict=True):
        width = rows if input_major else part.shape[0]
        KT[:, offset : offset + width].copy_(mask if input_major else mask.t())
        offset += width
    return KT


INNER_BLOCK = 32  # on a CPU: the inner block's rows stay in cache
GPU_INNER_BLOCK = 128  # on a GPU, with the Triton kernel: one launch per inner block, the fewer the better


def _inner_blocks(start: int, end: int, group: int | None, inner: int = INNER_BLOCK) -> list[tuple[int, int]]:
    """Split ``[start, end)`` at every multiple of ``inner`` and every group start, so a
    group's qparams are always taken when all earlier updates have reached its columns."""
    cuts = set(range(start, end, inner)) | {start, end}
    if group:
        cuts |= set(range(-(-start // group) * group, end, group))
    edges = sorted(cuts)
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class HessianFactor:
    """What GPTQ needs of a Hessian, computed once for every weight that shares it."""

    inverse: torch.Tensor  # upper Cholesky factor of the damped inverse, in update order
    perm: torch.Tensor | None  # the update's column order (activation ordering), else None
    dead: torch.Tensor  # columns no input ever reached
    dampening: float  # the dampening fraction that made the Hessian invertible


@torch.no_grad()
def factor_hessian(hessian: torch.Tensor, dampening_frac: float = 0.01, actorder: bool = False,
                   overwrite: bool = False, team: Team = ALONE) -> HessianFactor:
    """The factor of the Hessian ``[cols, cols]`` of a weight's inputs (``2/n * X^T X``). With
    ``actorder`` columns go in order of decreasing diagonal (the inputs with the most energy
    first). With ``overwrite`` the caller gives ``hessian`` up: the factor is computed in its
    memory (one Hessian-sized buffer less at the peak). ``team``: the processes that map
    ``hessian`` (with ``overwrite``) compute the factor in it together (``parallel/node.py``)."""
    if team is not ALONE and not overwrite:
        raise ValueError("a team factors a Hessian they share in place: pass overwrite=True")
    H = hessian.to(torch.float32)  # may be the caller's tensor: changed only on dead columns (unless given up)
    diagonal = torch.diag(H)
    dead = diagonal == 0
    perm = torch.argsort(diagonal.masked_fill(dead, 1), descending=True) if actorder else None
    owned = overwrite or H is not hessian
    team.sync()  # every member has read the diagonal before it changes
    if perm is not None and not owned:
        H = H.clone()
        owned = True
    if team.mine(0):
        H[dead, dead] = 1
    team.sync()
    if perm is not None:
        permute_rows_(H, perm, columns_too=True, team=team)
    inverse, used_damp = inverse_hessian_factor(H, dampening_frac, overwrite=owned, team=team)
    return HessianFactor(inverse, perm, dead, used_damp)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor | Sequence[torch.Tensor],
    hessian: torch.Tensor | HessianFactor,
    args: QuantizationArgs,
    *,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    overwrite_hessian: bool = False,
    input_major: bool = False,
    global_scale: torch.Tensor | None = None,
    keep: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> GPTQResult:
    """Quantize ``weight`` ``[rows, cols]`` (or the row blocks that stack into it) given the
    Hessian ``[cols, cols]`` of its inputs, or its ``factor_hessian`` (then ``dampening_frac``,
    ``actorder`` and ``overwrite_hessian`` were the factor's to use). With activation ordering
    the qparams come from the unpermuted weight.

    ``input_major``: the weight is stored ``[cols, rows]`` (GPT-2's Conv1D) and quantized in that
    layout, as compressed-tensors reads it: each column's qparams (channel: one; group: one per
    group of rows) come from the column itself at its turn, after every earlier column's update,
    and the result (weight, scales) is in the stored layout. One weight at a time.

    ``global_scale``: NVFP4's, ``[1]`` or one per row; fixed before the update, as the group
    scales are taken relative to it.

    ``keep``: a pruned weight's pattern (one boolean mask per part, in its layout): the weights
    outside it are zero in the result, each rounded to zero at its column's turn with its error
    spread like any rounding error (so a 2:4 model stays 2:4), and group qparams are taken over
    the kept weights."""
    factor = hessian if isinstance(hessian, HessianFactor) else factor_hessian(
        hessian, dampening_frac, actorder, overwrite=overwrite_hessian)
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if input_major:
        assert len(parts) == 1, "input-major weights are quantized one at a time"
        rows, cols = parts[0].shape[1], parts[0].shape[0]
    else:
        rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
    # The update runs on the transpose: each weight column is a contiguous row, so the
    # per-column work (rounding, rank-1 updates) reads and writes contiguous memory. Row
    # blocks (modules sharing the Hessian) are copied in side by side: no concatenated copy.
    # An input-major weight is that transpose already.
    WT = torch.empty(cols, rows, dtype=torch.float32, device=parts[0].device)
    offset = 0
    for part in parts:
        width = rows if input_major else part.shape[0]
        if input_major:
            WT[:, offset : offset + width].copy_(part.detach())
        else:
            native.transposed(part.detach(), out=WT[:, offset : offset + width])
        offset += width
    WT[factor.dead] = 0
    KT = None if keep is None else _kept_columns(keep, parts, cols, rows, input_major)
    if KT is not None:
        WT.masked_fill_(~KT, 0.0)

    perm, Hinv = factor.perm, factor.inverse
    by_column = input_major and args.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.GROUP)
    gs = None
    if args.has_global_scale:
        if global_scale is None or input_major:
            raise SchemeError("GPTQ on NVFP4 needs each weight's global scale, on an [out, in] weight",
                              got="input-major weight (Conv1D)" if input_major else "no global_scale",
                              expected="an nn.Linear and its weight_global_scale", fix="add the module to ignore")
        gs = global_scale.to(torch.float32).reshape(-1, 1).expand(rows, 1)
    fixed_scale, fixed_zp = (None, None) if by_column else _upfront_qparams(WT.t(), args, perm is not None, scale_dtype, gs)
    col_scale, col_zp = _per_column(fixed_scale, fixed_zp, WT.t(), args, perm)
    if col_scale is not None and gs is not None:  # the grid's own step: group scale over global scale
        col_scale = col_scale / gs
    if perm is not None:
        permute_rows_(WT, perm)  # WT is ours: in place
        KT = None if KT is None else KT[perm]

    scale_rows = None if col_scale is None else col_scale.t().contiguous()
    zp_rows = None if col_zp is None else col_zp.t().contiguous()
    group = args.group_size if args.is_grouped and not by_column else None
    group_scales, group_zps = [], []
    channel = _group_args(args)
    row_loss = torch.zeros(rows, dtype=torch.float64, device=WT.device)
    scale = zp = None
    rounding = _Rounding(args)

    def take_group_qparams(col: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A new group: qparams from its (already updated) columns, as one per weight row."""
        columns = WT[col : col + group] if KT is None else WT[col : col + group] * KT[col : col + group]
        g_scale, g_zp = _qparams(columns.t(), channel, scale_dtype, gs)
        group_scales.append(g_scale)
        group_zps.append(g_zp)
        return (g_scale[:, 0] if gs is None else g_scale[:, 0] / gs[:, 0]), (None if g_zp is None else g_zp[:, 0].float())

    # llmpress's operator runs the per-column steps of integer grids (not Conv1D's column-wise qparams)
    native_columns = KT is None and not by_column and (
        on_native_grid(args, WT) or (not args.is_float and native.gpu_columns_available(WT.device)))
    inner_width = GPU_INNER_BLOCK if native_columns and WT.is_cuda else INNER_BLOCK
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        Err1 = torch.empty(end - start, rows, dtype=WT.dtype, device=WT.device)
        Hinv1 = Hinv[start:end, start:end]
        inv_diag = 1.0 / torch.diagonal(Hinv1)
        if not native_columns:  # rows made once per block: per column only the arithmetic goes through torch
            w_rows, err_rows = WT[start:end].unbind(0), Err1.unbind(0)
            pruned_rows = None if KT is None else (~KT[start:end]).unbind(0)
        for inner_start, inner_end in _inner_blocks(start, end, group, inner_width):
            # rank-1 updates stay inside a narrow inner block; the rest of the block gets one
            # matrix product per inner block: the same arithmetic, far less memory traffic
            a, b = inner_start - start, inner_end - start
            inner = WT[inner_start:inner_end]
            # row i of the factor right of its diagonal, over the diagonal entry: times column
            # i's rounding error w - q it is GPTQ's update of the inner block's later columns
            # (zeros on and left of the diagonal add exactly zero to the columns done)
            upper = Hinv1[a:b, a:b].triu(1) * inv_diag[a:b, None]
            if native_columns:  # the inner block's columns in one operator call, the same arithmetic
                if scale_rows is None and inner_start % group == 0:
                    scale, zp = take_group_qparams(inner_start)
                if scale_rows is None:  # the group's qparams for every column
                    block_scale, block_zp = scale.expand(b - a, rows), None if zp is None else zp.expand(b - a, rows)
                else:
                    block_scale = scale_rows[inner_start:inner_end]
                    block_zp = None if zp_rows is None else zp_rows[inner_start:inner_end]
                native.gptq_columns(inner, Err1[a:b], upper, block_scale, block_zp, *args.q_range)
            else:
                upper = upper.unbind(0)
                for i in range(a, b):
                    col = start + i
                    if scale_rows is not None:
                        scale, zp = scale_rows[col], None if zp_rows is None else zp_rows[col]
                    elif by_column:  # this column's own qparams, over groups of rows
                        g_scale, g_zp = _qparams(WT[col : col + 1] if KT is None else WT[col : col + 1] * KT[col : col + 1],
                                                 args, scale_dtype)
                        group_scales.append(g_scale)
                        group_zps.append(g_zp)
                        scale = expand_to_columns(g_scale, rows, args)[0]
                        zp = None if g_zp is None else expand_to_columns(g_zp, rows, args)[0].float()
                    elif col % group == 0:
                        scale, zp = take_group_qparams(col)
                    w, err = w_rows[i], err_rows[i]
                    q = rounding(w, scale, zp)
                    if pruned_rows is not None:  # a pruned weight rounds to zero
                        q.masked_fill_(pruned_rows[i], 0.0)
                    torch.sub(w, q, out=err)
                    if by_column:  # its qparams are its own: onto the grid now
                        w.copy_(q)
                    if i + 1 < b:
                        inner.addr_(upper[i - a], err, alpha=-1)
                # a column is not changed after its turn, so the inner block goes onto the grid at
                # once: the same rounding, elementwise, of the same values as in each column's turn
                if scale_rows is not None:
                    scale = scale_rows[inner_start:inner_end]
                    zp = None if zp_rows is None else zp_rows[inner_start:inner_end]
                if not by_column:
                    inner.copy_(rounding(inner, scale, zp))
                    if KT is not None:
                        inner.masked_fill_(~KT[inner_start:inner_end], 0.0)
            Err1[a:b].mul_(inv_diag[a:b, None])  # GPTQ's error: (w - q) / d
            if inner_end < end:
                WT[inner_end:end].addmm_(Hinv1[a:b, b:].t(), Err1[a:b], alpha=-1)
        row_loss += Err1.square().sum(dim=0)
        if end < cols:
            WT[end:].addmm_(Hinv[start:end, end:].t(), Err1, alpha=-1)

    unperm = None if perm is None else torch.argsort(perm)
    if unperm is not None:
        permute_rows_(WT, unperm)  # back in place: no second weight at the return
    W = WT if input_major else WT.t()  # a view: callers copy the rows they need
    if fixed_scale is not None:
        scale, zero_point = fixed_scale, fixed_zp
    elif by_column:  # one row of qparams per column, in the update's order
        scale = torch.cat(group_scales, dim=0)
        zero_point = None if group_zps[0] is None else torch.cat(group_zps, dim=0)
        if unperm is not None:
            scale = scale[unperm]
            zero_point = None if zero_point is None else zero_point[unperm]
    else:
        scale = torch.cat(group_scales, dim=1)
        zero_point = None if group_zps[0] is None else torch.cat(group_zps, dim=1)
    return GPTQResult(W, scale, zero_point, float(row_loss.sum()), row_loss, factor.dampening)
