"""GPTQ's inner block on a CUDA GPU in one Triton kernel: ``native.gptq_columns`` for CUDA tensors.

In PyTorch each column of the inner block is about seven kernel launches (divide, round, clamp,
multiply, subtract, the rank-1 update of the later columns); a 4096 x 14336 weight has 14336
columns, so a layer of a Llama-3-8B-shaped model is about 400 000 launches, and the GPU waits on
the host. Here one launch does a whole inner block: each program takes a strip of weight rows
(columns of the transposed layout ``inner`` ``[n, rows]``) with all ``n`` of the block's columns in
registers and walks the columns in order. Rows never interact inside the block, so the strips
run in parallel with no synchronisation.

The arithmetic is the CPU operator's (``gptq.cpp``) and ``_Rounding``'s: an IEEE division, round
half to even, the zero point added and clamped, multiplied back; the later columns' update is one
fused multiply-add. Imported on first use (``native.gptq_columns``): Triton is a CUDA machine's
package, absent from CPU installs, and its import costs a CPU run nothing it needs.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["gptq_columns"]

ROWS_PER_PROGRAM = 32  # a strip of 32 weight rows x up to 128 columns: 32 float32 registers a thread at 4 warps


@triton.jit
def _columns_kernel(inner, err, upper, scale, zero, width, scale_step, zero_step, q_min, q_max,
                    n: tl.constexpr, HAS_ZERO: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < width
    ks = tl.arange(0, N)
    k_ok = ks < n
    tile = tl.load(inner + ks[:, None] * width + rows[None, :], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
    for i in range(n):
        this = (ks == i)[:, None]
        w = tl.sum(tl.where(this, tile, -0.0), axis=0)  # column i, after every earlier column's update (-0.0 kept)
        s = tl.load(scale + i * scale_step + rows, mask=row_ok, other=1.0)
        # round half to even: adding and taking away 1.5 * 2^23 leaves no fraction bits, and
        # float addition rounds to even (|x| is kept under 2^22 first: any grid clamps there anyway)
        x = tl.minimum(tl.maximum(tl.math.div_rn(w, s), -4194304.0), 4194304.0)
        q = (x + 12582912.0) - 12582912.0
        q = tl.where(q == 0.0, x * 0.0, q)  # a value rounded to zero keeps its sign, as rint's -0.0
        if HAS_ZERO:
            z = tl.load(zero + i * zero_step + rows, mask=row_ok, other=0.0)
            q = tl.minimum(tl.maximum(q + z, q_min), q_max) - z
        else:
            q = tl.minimum(tl.maximum(q, q_min), q_max)
        q = q * s
        d = w - q
        tl.store(inner + i * width + rows, q, mask=row_ok)
        tl.store(err + i * width + rows, d, mask=row_ok)
        # later columns k > i take -upper[i, k] * d (upper is zero on and left of its diagonal)
        u = tl.load(upper + i * n + ks, mask=k_ok, other=0.0)
        tile = tl.fma(-u[:, None], d[None, :], tile)


def gptq_columns(inner: torch.Tensor, err: torch.Tensor, upper: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, q_min: float, q_max: float) -> None:
    """``native.gptq_columns`` on CUDA tensors: ``inner``, ``err`` ``[n, rows]`` contiguous,
    ``upper`` ``[n, n]`` contiguous, ``scale`` / ``zero`` ``[n, rows]`` with contiguous rows (a row
    may repeat: stride 0), all float32 on one GPU; ``n`` at most 128."""
    n, width = inner.shape
    if n == 0:
        return
    for name, t in (("inner", inner), ("err", err), ("scale", scale), ("zero", zero)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (n, width) or t.stride(1) != 1 or t.device != inner.device):
            raise ValueError(f"gptq_columns: {name} must be float32 [{n}, {width}] with contiguous rows on {inner.device}")
    if not (inner.is_contiguous() and err.is_contiguous() and upper.is_contiguous() and upper.shape == (n, n) and n <= 128):
        raise ValueError("gptq_columns: inner, err and upper [n, n] must be contiguous, n at most 128")
    grid = (triton.cdiv(width, ROWS_PER_PROGRAM),)
    # on the tensors' GPU and its current stream; no fused multiply-add but the update's own
    # (``q * s`` then ``w - q`` round twice, as the CPU operator built with -ffp-contract=off)
    with torch.cuda.device(inner.device) if inner.is_cuda else contextlib.nullcontext():  # (the interpreter: host tensors)
        _columns_kernel[grid](inner, err, upper, scale, zero if zero is not None else scale, width, scale.stride(0),
                              zero.stride(0) if zero is not None else 0, float(q_min), float(q_max),
                              n=n, HAS_ZERO=zero is not None, N=max(16, triton.next_power_of_2(n)), ROWS=ROWS_PER_PROGRAM,
                              enable_fp_fusion=False)
