"""int8 × int8 matrix products for W8A8 modules (int8 weights and int8 input activations).

A W8A8 module's input is quantized to int8 (per token or per tensor, dynamic or with its
calibrated scale, as the scheme says), multiplied with the int8 weight in integers, and the
integer result scaled back: what vLLM computes, here on oneDNN's quantized linear
(``onednn::qlinear_pointwise``, uint8 inputs with a zero point against int8 weights): the
fastest int8 product PyTorch has on a CPU, faster than fp32 and far faster than ``torch._int_mm``
(the figures: ``bench/README.md``, "Figures behind the code").

One pass is exact only where the CPU multiplies int8 pairs into int32 (VNNI). Without it (AVX2,
AVX-512F) the product goes through ``vpmaddubsw``, which adds two ``uint8 × int8`` products into
int16 and saturates: 255 × 127 × 2 > 32767, a relative error of about 1e-2 on random inputs. The
sum cannot saturate when every weight is within ±64, so weights beyond that are split into two
halves (``w = floor(w / 2) + ceil(w / 2)``) that run as one product with twice the rows; the
result is exact, and the two passes cost about what one fp32 product does. Few-token inputs
(decode) run faster on the bf16 int8-weight kernel, so ``QuantizedLinear`` uses this product
only from ``MIN_ROWS`` rows on.
"""

from __future__ import annotations

import functools

import torch

from llmpress.quant.qdq import activation_qparams, quantize
from llmpress.quant.scheme import QuantizationArgs, QuantizationStrategy

__all__ = ["MIN_ROWS", "Int8Inputs", "int8_inputs_supported"]

MIN_ROWS = 32  # below this many rows the bf16 int8-weight kernel is faster (as measured at 2048 x 2048)
_SHIFT = 128  # int8 values + 128 = the uint8 values oneDNN takes
_SAFE = 64  # |w| <= 64: a uint8 x int8 pair sum stays within int16


def _onednn_product(shifted: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = weight.shape[0]
    return _product(shifted, torch.ops.onednn.qlinear_prepack(weight, None), torch.ones(rows), torch.zeros(rows, dtype=torch.long))


@functools.cache
def _available() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")):
        return False
    if not all(hasattr(torch.ops.onednn, op) for op in ("qlinear_prepack", "qlinear_pointwise")):
        return False
    try:  # one small product, checked: the op exists but may not run on every build
        out = _onednn_product(torch.tensor([[129, 126]], dtype=torch.uint8), torch.tensor([[1, -2], [3, 4]], dtype=torch.int8))
        return torch.equal(out, torch.tensor([[5.0, -5.0]]))
    except RuntimeError:
        return False


@functools.cache
def _one_pass_exact() -> bool:
    """Whether oneDNN multiplies uint8 × int8 here without saturating an int16 pair sum (VNNI,
    AVX-VNNI, AMX), found by trying: 255 × 127 twice is 64770, beyond int16."""
    width = 64  # several kernel blocks' worth of pairs
    shifted = torch.full((1, width), 255, dtype=torch.uint8)  # the value 127 after the shift of 128
    out = _onednn_product(shifted, torch.full((16, width), 127, dtype=torch.int8))
    return bool(torch.all(out == 127.0 * 127 * width))


def int8_inputs_supported(weights: QuantizationArgs, inputs: QuantizationArgs | None) -> bool:
    """Whether a module with these weight and input args runs on the int8 × int8 product:
    symmetric 8-bit integer weights per channel or tensor, 8-bit integer inputs per token or
    tensor (dynamic or static, symmetric or not)."""
    return (
        inputs is not None
        and not inputs.is_float
        and inputs.num_bits == 8
        and inputs.strategy in (QuantizationStrategy.TOKEN, QuantizationStrategy.TENSOR)
        and weights.symmetric
        and _available()
    )


def _product(shifted: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``(shifted - 128) @ w.T`` in float32 (exact integers): oneDNN takes the zero point, and
    unit scales leave the integers as they are."""
    return torch.ops.onednn.qlinear_pointwise(shifted, 1.0, _SHIFT, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], "")


class Int8Inputs:
    """The prepacked weight of one module and its int8 × int8 product (not a buffer: the packed
    layout is oneDNN's own and is rebuilt from ``int8_weight`` when needed)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, inputs: QuantizationArgs) -> None:
        self.inputs = inputs
        self.out_features = weight.shape[0]
        self.weight_scale = weight_scale.to(torch.float32).reshape(-1)  # [out] or [1]
        largest = max(int(weight.max()), -int(weight.min()))  # not abs(): int8 -128 stays -128
        self.split = not _one_pass_exact() and largest > _SAFE
        if self.split:
            low = torch.div(weight, 2, rounding_mode="floor")
            weight = torch.cat([low, weight - low])
        self.packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
        self.rows = weight.shape[0]
        self.ones = torch.ones(self.rows)
        self.zeros = torch.zeros(self.rows, dtype=torch.long)
        # for inputs with a zero point: sum over k of w[n, k], the zero point's share of each output
        sums = weight.float().sum(dim=1)
        self.weight_sums = sums[: self.out_features] + sums[self.out_features :] if self.split else sums

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def matmul(self, flat: torch.Tensor, input_scale: torch.Tensor | None, input_zero_point: torch.Tensor | None) -> torch.Tensor:
        """``x_q @ w_q.T`` scaled back, for ``flat`` ``[tokens, in]``: float32 ``[tokens, out]``."""
        scale, zero_point = activation_qparams(flat, self.inputs, input_scale, input_zero_point)
        scale = scale.to(torch.float32)
        # int8 q + 128 as uint8 is q's bits with the sign bit flipped
        shifted = quantize(flat, scale, zero_point, self.inputs).view(torch.uint8).bitwise_xor_(_SHIFT)
        out = _product(shifted, self.packed, self.ones, self.zeros)
        if self.split:
            out = out[:, : self.out_features] + out[:, self.out_features :]
        if zero_point is not None:  # (x_q - zp) @ w.T = x_q @ w.T - zp * sum_k w
            out = out - zero_point.to(torch.float32).reshape(-1, 1) * self.weight_sums
        return out.mul_(scale.reshape(-1, 1) if scale.numel() > 1 else scale).mul_(self.weight_scale)
