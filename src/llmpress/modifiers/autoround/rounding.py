"""One weight under tuning: AutoRound's rounding offsets and range scales, and the weight they give.

The weight ``W`` is rounded as ``q = round(W / s + V) (+ zero point)`` on its
scheme's grid, ``V`` (the rounding offset, one per weight, in [-0.5, 0.5]) tuned, and the scale
``s`` and zero point computed by ``quant.qdq.compute_qparams`` from the unit's range
``[min * min_scale, max * max_scale]``, ``min_scale`` / ``max_scale`` (one per group, channel or
tile, in [0, 1]) tuned too: clipping learned from the block's output. With ``V = 0`` and both
scales 1 the weight is round-to-nearest with a min/max observer (symmetric integers on the
whole grid: ``_exact_qparams``).

The values are always the exact ones the checkpoint stores (compute_qparams's scale, fp8 group
scales for NVFP4, powers of two for MX); gradients reach the scales through a smooth stand-in of
the same value (``absmax / half range``, the fp8 or power-of-two rounding left out) and pass the
grid's rounding unchanged (straight-through), as in Cheng et al., "Optimize Weight Rounding via
Signed Gradient Descent" (2023).
"""

from __future__ import annotations

from typing import Any

import torch

from llmpress import native
from llmpress.quant.qdq import (
    compute_qparams,
    effective_scale,
    expand_to_columns,
    expand_to_weight,
    reduce_min_max,
    round_to_grid,
)
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["TunedWeight"]

_EPS = torch.finfo(torch.float32).eps  # the smallest scale magnitude, as compute_qparams clamps it


def _straight_through(value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``exact``'s values with ``value``'s gradient."""
    return value + (exact.to(value.dtype) - value).detach()


class _OnGrid(torch.autograd.Function):
    """``_on_grid`` for an integer or fp4 grid in groups or channels, as native operators: the
    same values bit for bit, the gradients in one pass (``native/autoround.cpp``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, zero_point: torch.Tensor | None,
                group: int, q_min: float, q_max: float, fp4: bool) -> torch.Tensor:
        ctx.save_for_backward(weight, offset, step, zero_point)
        ctx.grid = (group, q_min, q_max, fp4)
        return native.autoround_qdq(weight, offset, step, zero_point, group, q_min, q_max, fp4)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        weight, offset, step, zero_point = ctx.saved_tensors
        d_offset, d_step, d_zero = native.autoround_qdq_backward(grad.to(torch.float32).contiguous(), weight, offset, step,
                                                                 zero_point, *ctx.grid)
        return None, d_offset, d_step, d_zero, None, None, None, None


class TunedWeight:
    """``weight`` (a module's, as stored: ``[out, in]``, a Conv1D's ``[in, out]``, its qparams
    along the last dimension either way) with its tunable offsets and range scales. Scales are
    rounded to ``scale_dtype`` (what the checkpoint stores) while tuning too, so the weight kept
    is the one tuned."""

    def __init__(self, weight: torch.Tensor, args: QuantizationArgs, global_scale: torch.Tensor | None,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        self.args, self.scale_dtype = args, scale_dtype
        self.global_scale = None if global_scale is None else global_scale.to(torch.float32)
        self.weight = weight.detach().to(torch.float32).contiguous()
        low, high = reduce_min_max(self.weight, args)
        self.low, self.high = low.clamp(max=0.0), high.clamp(min=0.0)
        self.offset = torch.zeros_like(self.weight, requires_grad=True)
        self.min_scale = torch.ones_like(self.low, requires_grad=True)
        self.max_scale = torch.ones_like(self.high, requires_grad=True)

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [self.offset, self.min_scale, self.max_scale]

    def state(self) -> list[torch.Tensor]:
        """A copy of the tuned values (the best so far)."""
        return [p.detach().clone() for p in self.parameters]

    def load(self, state: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, value in zip(self.parameters, state):
                p.copy_(value)

    @torch.no_grad()
    def clamp_(self) -> None:
        """Keep the offsets within half a step and the scales within the observed range."""
        self.offset.clamp_(-0.5, 0.5)
        self.min_scale.clamp_(0.0, 1.0)
        self.max_scale.clamp_(0.0, 1.0)

    def _exact_qparams(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scale (float32 holding ``scale_dtype`` values) and zero point of the range
        ``[low, high]`` as stored. Symmetric integers use the whole grid: the larger side of each
        unit lands on the grid's end, ``-2^(b-1)`` (a negative scale where that side is
        positive), so 4 bits give 16 levels of ``absmax / 8`` rather than ``absmax / 7.5`` with
        the top one clipped, as auto-round does."""
        args = self.args
        if args.symmetric and not args.is_float:
            scale = torch.where(high > -low, high, low) / args.q_range[0]
            scale, zero_point = torch.where(scale < 0, scale.clamp(max=-_EPS), scale.clamp(min=_EPS)), None
        else:
            scale, zero_point = compute_qparams(low, high, args, self.global_scale)
        return scale.to(self.scale_dtype).to(torch.float32), zero_point

    def _qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scale (NVFP4: relative to the global scale) and zero point of the tuned range:
        exact values, smooth gradients."""
        args = self.args
        low, high = self.low * self.min_scale, self.high * self.max_scale
        scale, zero_point = self._exact_qparams(low.detach(), high.detach())
        q_min, q_max = args.q_range
        if args.symmetric and not args.is_float:
            return _straight_through(torch.where(high > -low, high, low) / q_min, scale), None
        if args.symmetric:
            smooth = torch.maximum(-low, high) / q_max
            if args.has_global_scale:
                smooth = smooth * self.global_scale
            return _straight_through(smooth, scale), None
        scale = _straight_through((high - low) / (q_max - q_min), scale)
        return scale, _straight_through(q_min - low / scale, zero_point.to(torch.float32))

    def _expand(self, qparam: torch.Tensor) -> torch.Tensor:
        """A per-unit qparam broadcast against the weight."""
        args = self.args
        if args.strategy == QuantizationStrategy.BLOCK:
            return expand_to_weight(qparam, self.weight.shape, args)
        if args.is_grouped:
            return expand_to_columns(qparam, self.weight.shape[-1], args)
        return qparam

    def _native_group(self) -> int | None:
        """Columns per qparam where the native operators take this weight (an integer or fp4
        grid in groups or channels of a 2-D CPU weight), else None."""
        args = self.args
        by_rows = (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP, QuantizationStrategy.CHANNEL)
        if ((args.is_float and not args.is_fp4) or args.strategy not in by_rows or self.weight.dim() != 2
                or self.weight.device.type != "cpu" or not native.available()):
            return None
        return args.group_size if args.is_grouped else self.weight.shape[-1]

    def _on_grid(self, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
        """``round(W / scale + V) (+ zero point)`` on the grid, dequantized (float32), the
        rounding's gradient passed straight through. The clamp is taken where auto-round takes
        it: after the rounding on integer grids (the gradient passes where the rounded value lies
        on the grid, so a weight within half a step past its end can still be rounded inward),
        before it on float grids (fp8's cast, and fp4 as its nv_fp4 and mx_fp4 quantizers do)."""
        group = self._native_group()
        if group is not None:
            step = effective_scale(scale, self.args, self.global_scale).contiguous()
            zero = None if zero_point is None else zero_point.to(torch.float32).contiguous()
            return _OnGrid.apply(self.weight, self.offset, step, zero, group, *map(float, self.args.q_range), self.args.is_fp4)
        step = self._expand(effective_scale(scale, self.args, self.global_scale))
        x = self.weight / step + self.offset
        if zero_point is not None:
            zero_point = self._expand(zero_point.to(torch.float32))
            x = x + zero_point
        if self.args.is_float:  # clamped, then rounded: the gradient passes where the value lies in range
            x = x.clamp(*self.args.q_range)
            q = _straight_through(x, round_to_grid(x.detach().clone(), self.args).to(torch.float32))
        else:  # rounded, then clamped: the gradient passes where the rounded value lies on the grid
            q = _straight_through(x, round_to_grid(x.detach().clone(), self.args, clamp=False)).clamp(*self.args.q_range)
        q = q + 0.0  # -0.0 -> 0.0
        if zero_point is not None:
            q = q - zero_point
        return q * step

    def dequantized(self) -> torch.Tensor:
        """The weight on its grid under the current offsets and scales, differentiable in them."""
        return self._on_grid(*self._qparams())

    @torch.no_grad()
    def final(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The weight on its grid (float32), its scale in ``scale_dtype`` and its zero point
        (int8, or None): what the module stores."""
        self.clamp_()
        scale, zero_point = self._exact_qparams(self.low * self.min_scale, self.high * self.max_scale)
        return self._on_grid(scale, zero_point), scale.to(self.scale_dtype), zero_point
