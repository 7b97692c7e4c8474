"""The GPTQ update (Frantar et al., 2022) as one pure function on a weight and its Hessian.

Columns are quantized one at a time; each column's rounding error is spread over the columns not
yet quantized through the Cholesky factor of the inverse Hessian, so the layer's output error
``||W X - Q X||`` stays small. Columns go in blocks ("lazy batch"): inside a block updates are
rank-1, and the rest of the matrix gets one matrix product per block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmpress.errors import UnsupportedModelError
from llmpress.quant.observers import weight_qparams
from llmpress.quant.qdq import expand_to_columns
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["GPTQResult", "gptq_quantize", "inverse_hessian_factor"]

logger = logging.getLogger(__name__)

MAX_DAMPENING_RETRIES = 6


@dataclass
class GPTQResult:
    weight: torch.Tensor  # on the quantization grid, float32, [rows, cols]
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    loss: float  # sum over entries of (w - q)^2 / d^2: GPTQ's own error measure
    dampening: float  # the dampening fraction that made the Hessian invertible


def inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp * I)^-1``; retries with 10x more dampening (up to
    ``MAX_DAMPENING_RETRIES`` times) instead of failing on a Hessian that is not positive definite."""
    mean_diag = float(torch.mean(torch.diag(hessian)))
    frac = dampening_frac
    for attempt in range(MAX_DAMPENING_RETRIES + 1):
        hessian.diagonal().add_(frac * mean_diag)  # in place, undone below on failure
        factor, info = torch.linalg.cholesky_ex(hessian)
        hessian.diagonal().sub_(frac * mean_diag)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            del factor
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper, frac
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


def _channel_args(args: QuantizationArgs) -> QuantizationArgs:
    return args.model_copy(update={"strategy": QuantizationStrategy.CHANNEL, "group_size": None})


def _qparams(weight: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype):
    """Observer qparams with the scale rounded to the dtype it will be stored in, so the grid
    GPTQ rounds onto is exactly the one the checkpoint describes."""
    scale, zero_point = weight_qparams(weight, args)
    return scale.to(scale_dtype).to(torch.float32), zero_point


def _upfront_qparams(weight: torch.Tensor, args: QuantizationArgs, actorder: bool, scale_dtype: torch.dtype):
    """Scale / zero point fixed before the update starts, or (None, None) when group qparams are
    computed as the update reaches each group (groups without activation ordering)."""
    if args.strategy == QuantizationStrategy.GROUP and not actorder:
        return None, None
    return _qparams(weight, args, scale_dtype)


def _per_column(scale, zero_point, weight: torch.Tensor, args: QuantizationArgs, perm: torch.Tensor | None):
    """Qparams broadcast to one per column ``[rows, cols]``, in the update's column order."""
    if scale is None:
        return None, None
    cols = weight.shape[1]
    scale = expand_to_columns(scale, cols, args).expand(weight.shape[0], cols)
    zero_point = None if zero_point is None else expand_to_columns(zero_point, cols, args).expand(weight.shape[0], cols)
    if perm is not None:
        scale = scale[:, perm]
        zero_point = None if zero_point is None else zero_point[:, perm]
    return scale.contiguous(), None if zero_point is None else zero_point.float().contiguous()


def _round_column(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs) -> torch.Tensor:
    q_min, q_max = args.q_range
    if args.is_float:
        return (w / scale).clamp(q_min, q_max).to(torch.float8_e4m3fn).float() * scale
    if zero_point is None:
        return torch.clamp(torch.round(w / scale), q_min, q_max) * scale
    return (torch.clamp(torch.round(w / scale) + zero_point, q_min, q_max) - zero_point) * scale


INNER_BLOCK = 32


def _inner_blocks(start: int, end: int, group: int | None) -> list[tuple[int, int]]:
    """Split ``[start, end)`` at every multiple of ``INNER_BLOCK`` and every group start, so a
    group's qparams are always taken when all earlier updates have reached its columns."""
    cuts = set(range(start, end, INNER_BLOCK)) | {start, end}
    if group:
        cuts |= set(range(-(-start // group) * group, end, group))
    edges = sorted(cuts)
    return list(zip(edges[:-1], edges[1:]))


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    args: QuantizationArgs,
    *,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> GPTQResult:
    """Quantize ``weight`` ``[rows, cols]`` given the Hessian ``[cols, cols]`` of its inputs
    (``2/n * X^T X``). With ``actorder`` columns go in order of decreasing Hessian diagonal
    (the inputs with the most energy first); qparams then come from the unpermuted weight."""
    W = weight.detach().to(torch.float32).clone()
    H = hessian.to(torch.float32)  # may be the caller's tensor: changed only on dead columns
    rows, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    fixed_scale, fixed_zp = _upfront_qparams(W, args, actorder, scale_dtype)
    col_scale, col_zp = _per_column(fixed_scale, fixed_zp, W, args, perm)
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    Hinv, used_damp = inverse_hessian_factor(H, dampening_frac)

    group = args.group_size if args.strategy == QuantizationStrategy.GROUP else None
    group_scales, group_zps = [], []
    channel = _channel_args(args)
    loss = 0.0
    scale = zp = None
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        W1 = W[:, start:end].clone()
        Q1 = torch.empty_like(W1)
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[start:end, start:end]
        inv_diag = 1.0 / torch.diagonal(Hinv1)
        for inner_start, inner_end in _inner_blocks(start, end, group):
            # rank-1 updates stay inside a narrow inner block; the rest of the block gets one
            # matrix product per inner block: the same arithmetic, far less memory traffic
            for i in range(inner_start - start, inner_end - start):
                col = start + i
                if col_scale is not None:
                    scale, zp = col_scale[:, col], None if col_zp is None else col_zp[:, col]
                elif col % group == 0:  # a new group: qparams from its (already updated) columns
                    rest = W[:, end : col + group] if col + group > end else W[:, :0]
                    g_scale, g_zp = _qparams(torch.cat([W1[:, i : i + group], rest], dim=1), channel, scale_dtype)
                    group_scales.append(g_scale)
                    group_zps.append(g_zp)
                    scale = g_scale[:, 0]
                    zp = None if g_zp is None else g_zp[:, 0].float()
                w = W1[:, i]
                q = _round_column(w, scale, zp, args)
                Q1[:, i] = q
                err = (w - q).mul_(inv_diag[i])
                Err1[:, i] = err
                W1[:, i + 1 : inner_end - start].addr_(err, Hinv1[i, i + 1 : inner_end - start], alpha=-1)
            a, b = inner_start - start, inner_end - start
            W1[:, b:].addmm_(Err1[:, a:b], Hinv1[a:b, b:], alpha=-1)
        loss += float(Err1.square().sum())
        W[:, start:end] = Q1
        W[:, end:].addmm_(Err1, Hinv[start:end, end:], alpha=-1)

    if perm is not None:
        W = W[:, torch.argsort(perm)]
    if fixed_scale is not None:
        scale, zero_point = fixed_scale, fixed_zp
    else:
        scale = torch.cat(group_scales, dim=1)
        zero_point = None if group_zps[0] is None else torch.cat(group_zps, dim=1)
    return GPTQResult(W, scale, zero_point, loss, used_damp)
