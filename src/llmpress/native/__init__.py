"""llmpress's own CPU kernels: PyTorch operators built on first use.

``linear.cpp`` (with ``amx.cpp``'s tile products): ``torch.ops.llmpress.int4_linear``,
``int4_dequantize``, ``int8_linear`` and ``int8_linear_bf16``, the runtime's products for 4-bit
and 8-bit weights. ``gptq.cpp``: ``gptq_columns`` and ``candidate_errors``, GPTQ's
per-column update and the MSE observer's scoring, each one call where PyTorch takes hundreds of
small ones. ``gram.cpp``: ``gram_bf16_add_``, the Hessians' ``X^T X`` of bf16 inputs on the
CPU's bf16 units, summed in float32 (PyTorch's bf16 product rounds it to bf16). ``fp4.cpp``:
``fp4_quantize_pack``, NVFP4 / MXFP4 rounding and packing in one pass, and ``group_min_max``,
the ranges of small groups. ``autoround.cpp``: ``autoround_qdq`` and its backward, AutoRound's
tuned weight on its integer or fp4 grid and the gradients of its offsets, steps and zero points, one
pass each where PyTorch's autograd takes about thirty.

They are compiled once per source, compiler flags and PyTorch version by
``torch.utils.cpp_extension`` into ``$LLMPRESS_CACHE`` (default ``~/.cache/llmpress``): seconds,
once; later processes load the library in milliseconds. As operators they cost an eager call
what an aten operator costs (a ctypes or Python-defined operator costs several times more, which
a decode step of 200 small products feels), and a ``torch.compile``d model calls them as opaque
kernels.

They are used where the CPU has AVX2 and FMA and the build succeeds (it needs a C++ compiler);
otherwise ``available()`` is false and PyTorch's own operators run instead (the same GPTQ
results; the runtime on PyTorch's int4 kernel). ``LLMPRESS_NATIVE=0`` turns them off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "add_float32_", "add_gram_bf16_", "autoround_qdq", "autoround_qdq_backward", "available", "bf16_native", "candidate_errors", "cpu_flags", "fp4_quantize_pack", "group_min_max", "gptq_columns", "gpu_columns_available", "int4_dequantize", "int4_linear", "int8_linear",
    "int8_linear_bf16", "permute_rows_", "transposed",
]

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("linear.cpp", "amx.cpp", "gptq.cpp", "gram.cpp", "fp4.cpp", "autoround.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("blocks64.h", "rounding.h")]
# no contraction into fused multiply-adds: gptq.cpp repeats PyTorch's arithmetic step by step
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-std=c++17"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return frozenset()
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


@functools.cache
def bf16_native() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX), so that a bf16
    matrix product outruns float32 (several times, on AMX); elsewhere PyTorch emulates it, slower
    than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _build_dir() -> Path:
    root = Path(os.environ.get("LLMPRESS_CACHE") or Path.home() / ".cache" / "llmpress")
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS]) + " ".join([*FLAGS, torch.__version__, sys.version]).encode()).hexdigest()[:16]
    return root / "kernels" / key


@functools.cache
def available() -> bool:
    """True where llmpress's operators run on this machine (built or loaded on the first call)."""
    if os.environ.get("LLMPRESS_NATIVE", "1") == "0" or not {"avx2", "fma"} <= cpu_flags():
        return False
    if hasattr(torch.ops.llmpress, "gptq_columns"):
        return True
    build = _build_dir()
    library = build / "llmpress_kernels.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(build)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        logger.warning("llmpress's CPU kernels are not available (%s): PyTorch's operators run instead", str(exc)[:300])
        return False
    return True


def _build(build: Path) -> None:
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    logger.warning("building llmpress's CPU kernels (once for this PyTorch, about 15 s) in %s", build)
    with _ninja_on_path():
        cpp_extension.load(
            name="llmpress_kernels", sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, build_directory=str(build),
            is_python_module=False, verbose=False,
        )


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ninja wheel's binary on PATH for the build only (a venv that is not activated lacks
    it there); the caller's PATH is as it was afterwards."""
    try:
        import ninja
    except ImportError:
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, before or ""])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def int4_linear(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[..., in]`` and a weight in blocks of 32 (uint8 ``[out, in / 2]``)
    with its float32 ``[1 or 2, out, in / group]`` scales (and zeros); the result has ``x``'s
    dtype. Up to 16 tokens take the integer product, more a product on dequantized rows in x's
    dtype (float32 for dtypes other than bf16)."""
    return torch.ops.llmpress.int4_linear(x, weight, table, group)


def int8_linear_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, correction: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` in bf16 for a bf16 ``x`` ``[..., in]`` and an int8 weight ``[out, in]`` meaning
    ``w = q * scale - correction`` (one of each per output row), each row rounded to bf16 as
    a dense bf16 model holds it: the prefill product where the CPU multiplies bf16 natively."""
    return torch.ops.llmpress.int8_linear_bf16(x, weight, scale, correction)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, correction: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` for up to 16 rows of a float32 or bf16 ``x`` ``[..., in]`` (``in`` a multiple
    of 32) and an int8 weight ``[out, in]`` meaning ``w = q * scale - correction`` (float32, one of
    each per output row), as an integer product at memory speed: the decode product of 8-bit
    weights. The result has ``x``'s dtype."""
    return torch.ops.llmpress.int8_linear(x, weight, scale, correction)


def int4_dequantize(weight: torch.Tensor, table: torch.Tensor, group: int) -> torch.Tensor:
    """The weight as float32 ``[out, in]``."""
    return torch.ops.llmpress.int4_dequantize(weight, table, group)


def gptq_columns(inner: torch.Tensor, err: torch.Tensor, upper: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, q_min: float, q_max: float) -> None:
    """One inner block of GPTQ's update, in place: ``inner`` ``[n, rows]`` (the block's columns
    of the weight, as rows) goes onto its integer grid column by column, ``err`` gets each
    column's ``w - q``, later columns take ``-upper[i, k] * (w - q)``. ``scale`` / ``zero``:
    ``[n, rows]`` (a row may repeat: stride 0). CUDA tensors go to the Triton kernel
    (``gptq_triton``, ``n`` at most 128), CPU ones to ``gptq.cpp``'s operator."""
    if inner.is_cuda:
        from llmpress.native import gptq_triton

        gptq_triton.gptq_columns(inner, err, upper, scale, zero, q_min, q_max)
        return
    torch.ops.llmpress.gptq_columns(inner, err, upper, scale, zero, q_min, q_max)


def gpu_columns_available(device: torch.device) -> bool:
    """Whether ``gptq_columns`` runs on ``device``, a CUDA GPU (with Triton installed, as CUDA
    builds of PyTorch install it); ``LLMPRESS_NATIVE=0`` turns it off too."""
    return device.type == "cuda" and os.environ.get("LLMPRESS_NATIVE", "1") != "0" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def autoround_qdq(weight: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, zero: torch.Tensor | None,
                  group: int, q_min: float, q_max: float, fp4: bool = False) -> torch.Tensor:
    """``(round(clamp(weight / step + offset (+ zero), q_min, q_max)) (- zero)) * step`` for a
    float32 ``weight`` and ``offset`` ``[rows, cols]`` and ``step`` / ``zero`` ``[rows, groups]``
    (one per ``group`` columns), rounded onto the integers or (``fp4``) the e2m1 values, bit for
    bit as PyTorch's operators compute it."""
    return torch.ops.llmpress.autoround_qdq(weight, offset, step, zero, group, q_min, q_max, fp4)


def autoround_qdq_backward(grad: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor, step: torch.Tensor,
                           zero: torch.Tensor | None, group: int, q_min: float, q_max: float,
                           fp4: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients of ``autoround_qdq``'s ``offset``, ``step`` and ``zero`` (None without one)
    for ``grad`` of its output: the rounding passed straight through, the clamp's where the
    rounded value lies on the grid (the clamp after the rounding)."""
    d_offset, d_step, d_zero = torch.ops.llmpress.autoround_qdq_backward(grad, weight, offset, step, zero, group, q_min, q_max,
                                                                         fp4)
    return d_offset, d_step, None if zero is None else d_zero


def candidate_errors(blocks: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, q_min: float, q_max: float) -> torch.Tensor:
    """Squared rounding error of each unit ``[rows, units, size]`` under each candidate
    ``scale`` / ``zero`` ``[candidates, rows, units]`` on the integer grid [q_min, q_max]."""
    return torch.ops.llmpress.candidate_errors(blocks, scale, zero, q_min, q_max)


def transposed(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.t()`` copied into ``out`` (new and contiguous by default), for 2-D float32 CPU tensors
    whose rows are contiguous: several times PyTorch's strided copy. Other tensors take PyTorch's copy."""
    if out is None:
        out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=x.device)
    if (x.dim() == 2 and x.dtype == out.dtype == torch.float32 and x.device.type == out.device.type == "cpu"
            and x.stride(1) == 1 and out.stride(1) == 1 and x.numel() > 0 and available()):
        torch.ops.llmpress.transpose_into(out, x)
    else:
        out.copy_(x.t())
    return out


def add_float32_(acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc += x`` for a float64 ``acc`` and a float32 ``x`` of one shape, each term converted
    exactly (what PyTorch's ``acc.add_(x)`` computes, without its float64 copy of ``x``)."""
    if (acc.dtype == torch.float64 and x.dtype == torch.float32 and acc.device.type == x.device.type == "cpu"
            and acc.is_contiguous() and x.is_contiguous() and acc.shape == x.shape and available()):
        torch.ops.llmpress.add_float32_(acc, x)
    else:
        acc.add_(x)


def permute_rows_(matrix: torch.Tensor, perm: torch.Tensor, columns_too: bool) -> bool:
    """``matrix[perm]`` (``columns_too``: ``matrix[perm][:, perm]``) in ``matrix``'s own memory
    where it is a contiguous float32 / float64 CPU matrix; False (nothing done) elsewhere."""
    if (matrix.device.type == "cpu" and matrix.dtype in (torch.float32, torch.float64) and matrix.dim() == 2
            and matrix.is_contiguous() and available()):
        torch.ops.llmpress.permute_rows_(matrix, perm.to(device="cpu", dtype=torch.int64), columns_too)
        return True
    return False


def add_gram_bf16_(blocks: list[torch.Tensor], starts: list[int], x: torch.Tensor) -> bool:
    """``blocks[k] += x[s, :, start_k:start_k + rows_k]^T @ x[s, :, start_k:]`` for each
    sequence ``s`` of a bf16 ``x`` ``[sequences, tokens, columns]`` in turn, each product summed
    in float32 and added to the float64 ``blocks``: the very sums of the float32 product of the
    converted inputs, up to the order of the float32 additions. Returns False (and adds nothing)
    where the CPU has no AVX-512 BF16 or the kernels are off; the caller multiplies instead."""
    if not ({"avx512_bf16", "avx512bw"} <= cpu_flags() and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 3 and all(b.dtype == torch.float64 and b.device.type == "cpu" for b in blocks) and available()):
        return False
    torch.ops.llmpress.gram_bf16_add_(blocks, starts, x.contiguous())
    return True


def fp4_quantize_pack(weight: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[torch.Tensor, int] | None:
    """``weight`` ``[rows, cols]`` (float32 or bf16) divided by its float32 group scales
    ``[rows, groups]``, rounded onto the fp4 e2m1 grid and packed two to a byte
    (``formats/fp4_packed.pack_fp4``'s bytes), with the count of NaN values met; None where the
    kernel does not take it (no AVX-512, another dtype, columns or groups not multiples of 16)."""
    if not ({"avx512f", "avx512bw", "avx512dq"} <= cpu_flags() and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 16 == 0 and group % 16 == 0
            and scale.dim() == 2 and scale.shape[0] == weight.shape[0] and available()):
        return None
    packed, nans = torch.ops.llmpress.fp4_quantize_pack(weight.contiguous(), scale.to(torch.float32).contiguous(), group)
    return packed, int(nans)


def group_min_max(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Min and max of each ``group`` values along the rows of ``x`` ``[rows, cols]`` (float32 or
    bf16; cols a multiple of ``group``, itself of 16), ``[rows, cols / group]`` in ``x``'s dtype,
    NaN propagated as ``amin`` / ``amax`` do; None where the kernel does not take it."""
    if not ({"avx512f", "avx512bw", "avx512dq"} <= cpu_flags() and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and group % 16 == 0 and x.shape[1] % group == 0 and available()):
        return None
    return torch.ops.llmpress.group_min_max(x.contiguous(), group)
