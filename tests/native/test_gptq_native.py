"""llmpress's GPTQ operators (native/gptq.cpp): the per-column update of an inner block and the
MSE observer's candidate scoring, against the PyTorch code they replace, and GPTQ as a whole
with and without them."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from llmpress import native
from llmpress.modifiers.gptq import algorithm
from llmpress.quant import observers
from llmpress.quant.scheme import QuantizationArgs

pytestmark = pytest.mark.skipif(not native.available(), reason="llmpress's CPU operators do not build on this machine")


@pytest.fixture
def torch_only(monkeypatch):
    """GPTQ and the observer on PyTorch's operators alone, as where the build fails."""

    def switch():
        monkeypatch.setattr(algorithm, "on_native_grid", lambda *args: False)
        monkeypatch.setattr(observers, "on_native_grid", lambda *args: False)

    return switch


def _columns_reference(inner, upper, scale, zero, q_min, q_max):
    """The inner block's loop in float64 where it must round once (the fused update), else
    step by step in float32 as algorithm._Rounding does."""
    inner, err = inner.clone(), torch.empty_like(inner)
    for i in range(inner.shape[0]):
        w = inner[i]
        q = torch.div(w, scale[i]).round_()
        q = q.clamp_(q_min, q_max) if zero is None else q.add_(zero[i]).clamp_(q_min, q_max).sub_(zero[i])
        q = q.mul_(scale[i])
        err[i] = w - q
        w.copy_(q)
        later = inner[i + 1 :]
        later.copy_((later.double() - upper[i, i + 1 :, None].double() * err[i].double()).float())
    return inner, err


@pytest.mark.parametrize(("n", "rows"), [(32, 300), (7, 5), (1, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("repeated_scale", [True, False])
def test_gptq_columns_is_the_update_rounded_once(n, rows, symmetric, repeated_scale):
    g = torch.Generator().manual_seed(n + rows)
    inner = torch.randn(n, rows, generator=g)
    upper = (torch.randn(n, n, generator=g) * 0.3).triu(1)
    scale = (torch.rand(rows if repeated_scale else n * rows, generator=g) + 0.5) * 0.3
    scale = scale.expand(n, rows) if repeated_scale else scale.view(n, rows)
    zero = None if symmetric else torch.randint(-2, 3, (rows,), generator=g).float().expand(n, rows)
    expected, expected_err = _columns_reference(inner, upper, scale, zero, -8.0, 7.0)
    err = torch.empty(n, rows)
    native.gptq_columns(inner, err, upper, scale, zero, -8.0, 7.0)
    assert torch.equal(err, expected_err)
    assert torch.equal(inner, expected)


def test_gptq_columns_refuses_other_layouts():
    inner, err, upper = torch.randn(4, 8), torch.empty(4, 8), torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="scale must be float32"):
        native.gptq_columns(inner, err, upper, torch.ones(8, 4).t(), None, -8.0, 7.0)
    with pytest.raises(RuntimeError, match="upper must be contiguous"):
        native.gptq_columns(inner, err, torch.zeros(4, 3), torch.ones(4, 8), None, -8.0, 7.0)


@pytest.mark.parametrize(("strategy", "cols"), [("group", 200), ("group", 256), ("channel", 37), ("tensor", 64)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_candidate_errors_match_pytorch(strategy, cols, symmetric, torch_only):
    args = QuantizationArgs(num_bits=4, strategy=strategy, group_size=64 if strategy == "group" else None, symmetric=symmetric)
    weight = torch.randn(48, cols, generator=torch.Generator().manual_seed(cols))
    weight[::5, ::7] *= 5
    low, high = observers.reduce_min_max(weight, args)
    if strategy == "tensor":
        low, high = low.reshape(1, 1), high.reshape(1, 1)
    factors = torch.tensor([1.0, 0.95, 0.9, 0.8]).reshape(-1, 1, 1)
    scale, zero = observers.compute_qparams(low * factors, high * factors, args)
    ours = observers._candidate_errors(weight, scale, zero, args, 2.0)
    torch_only()
    reference = observers._candidate_errors(weight, scale, zero, args, 2.0)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


def test_gptq_with_and_without_the_operators(torch_only):
    """The operators change GPTQ's arithmetic only in the last bit of some updates: the same loss
    to 1e-5 and, where qparams are fixed up front, nearly the same integers."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 384, generator=g)
    x = torch.randn(2048, 384, generator=g) @ torch.randn(384, 384, generator=g) * 0.1
    hessian = 2 / 2048 * x.t() @ x
    cases = list(itertools.product(["group", "channel"], [True, False], [False, True]))
    ours = {}
    for strategy, symmetric, actorder in cases:
        args = QuantizationArgs(num_bits=4, strategy=strategy, group_size=128 if strategy == "group" else None,
                                symmetric=symmetric, observer="mse", observer_kwargs={"norm": 2.0})
        ours[strategy, symmetric, actorder] = algorithm.gptq_quantize(weight.clone(), hessian.clone(), args, actorder=actorder)
    torch_only()
    for strategy, symmetric, actorder in cases:
        args = QuantizationArgs(num_bits=4, strategy=strategy, group_size=128 if strategy == "group" else None,
                                symmetric=symmetric, observer="mse", observer_kwargs={"norm": 2.0})
        reference = algorithm.gptq_quantize(weight.clone(), hessian.clone(), args, actorder=actorder)
        result = ours[strategy, symmetric, actorder]
        assert result.loss == pytest.approx(reference.loss, rel=1e-5)
        differ = float((result.weight != reference.weight).float().mean())
        assert differ < (0.001 if strategy == "channel" or actorder else 0.02), (strategy, symmetric, actorder, differ)


@pytest.mark.parametrize("shape", [(5632, 1024), (37, 13), (9, 64), (64, 9), (1, 5)])
def test_transposed_copies(shape):
    x = torch.randn(*shape)
    assert torch.equal(native.transposed(x), x.t())
    wide = torch.zeros(shape[1], shape[0] + 12)  # into columns 5.. of a wider matrix (GPTQ's stacked weights)
    native.transposed(x, out=wide[:, 5 : 5 + shape[0]])
    assert torch.equal(wide[:, 5 : 5 + shape[0]], x.t())
    assert not wide[:, :5].any() and not wide[:, 5 + shape[0] :].any()
    assert torch.equal(native.transposed(x.t()), x)  # rows not contiguous: PyTorch's copy
    assert torch.equal(native.transposed(x.double()), x.double().t())


@pytest.mark.parametrize("shape", [(128, 2816), (7, 333), (1, 3)])
def test_float64_sum_of_float32_terms(shape):
    total = torch.randn(*shape, dtype=torch.float64)
    term = torch.randn(*shape) * 1e3
    expected = total + term.double()
    native.add_float32_(total, term)
    assert torch.equal(total, expected)


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and native.gpu_columns_available(torch.device("cuda"))),
                          reason="needs a CUDA GPU and Triton")


@cuda
@pytest.mark.parametrize(("n", "rows"), [(128, 3000), (32, 300), (7, 5), (1, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("repeated_scale", [True, False])
def test_the_gpu_kernel_is_the_update_rounded_once(n, rows, symmetric, repeated_scale):
    """The Triton kernel (native/gptq_triton.py) does the CPU operator's arithmetic: an IEEE
    division, round half to even, one fused multiply-add per later column."""
    g = torch.Generator().manual_seed(n + rows)
    inner = torch.randn(n, rows, generator=g)
    upper = (torch.randn(n, n, generator=g) * 0.3 / n**0.5).triu(1)
    scale = (torch.rand(rows if repeated_scale else n * rows, generator=g) + 0.5) * 0.3
    scale = scale.expand(n, rows) if repeated_scale else scale.view(n, rows)
    zero = None if symmetric else torch.randint(-2, 3, (rows,), generator=g).float().expand(n, rows)
    expected, expected_err = _columns_reference(inner, upper, scale, zero, -8.0, 7.0)
    on_gpu, err = inner.cuda(), torch.empty(n, rows, device="cuda")
    native.gptq_columns(on_gpu, err, upper.cuda(), scale.cuda(), None if zero is None else zero.cuda(), -8.0, 7.0)
    assert torch.equal(err.cpu().view(torch.int32), expected_err.view(torch.int32))  # bits, -0.0 included
    assert torch.equal(on_gpu.cpu().view(torch.int32), expected.view(torch.int32))


INTERPRETED = """
import sys, torch
from llmpress.native import gptq_triton
case = torch.load(sys.argv[1])
gptq_triton.gptq_columns(case["inner"], case["err"], case["upper"], case["scale"], case["zero"], -8.0, 7.0)
torch.save(case, sys.argv[1])
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (a CUDA machine's package)")
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_gpu_kernel_interpreted_on_the_cpu(symmetric, tmp_path):
    """The Triton kernel run by Triton's interpreter (``TRITON_INTERPRET=1``, a process of its
    own: the switch is read at import) on host tensors: the same grid points as the update in
    float64, the errors to float32's precision (the interpreter's multiply-add rounds twice)."""
    n, rows = 37, 90
    g = torch.Generator().manual_seed(n)
    case = {"inner": torch.randn(n, rows, generator=g), "err": torch.empty(n, rows),
            "upper": (torch.randn(n, n, generator=g) * 0.05).triu(1),
            "scale": ((torch.rand(rows, generator=g) + 0.5) * 0.3).expand(n, rows),
            "zero": None if symmetric else torch.randint(-2, 3, (n, rows), generator=g).float()}
    expected, expected_err = _columns_reference(case["inner"], case["upper"], case["scale"], case["zero"], -8.0, 7.0)
    torch.save(case, tmp_path / "case.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", INTERPRETED, str(tmp_path / "case.pt")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "case.pt")
    torch.testing.assert_close(result["err"], expected_err, rtol=0, atol=1e-5)
    assert (result["inner"] != expected).float().mean() < 0.002  # a point off only where a value sat on a tie
    same = result["inner"] == expected  # and a value rounded to zero keeps its sign (-0.0), as PyTorch's round
    assert torch.equal(result["inner"][same].signbit(), expected[same].signbit())


@cuda
@pytest.mark.parametrize(("strategy", "actorder"), [("group", False), ("group", True), ("channel", False)])
def test_gptq_on_the_gpu_is_gptq_on_the_cpu(strategy, actorder):
    """A whole GPTQ on the GPU (inner blocks of 128 columns, one kernel each) against the CPU's
    (blocks of 32 through the CPU operator): the same loss to 1e-4, nearly the same grid points."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 1024, generator=g)
    x = torch.randn(4096, 1024, generator=g) @ torch.randn(1024, 1024, generator=g) * 0.05
    hessian = 2 / 4096 * x.t() @ x
    args = QuantizationArgs(num_bits=4, strategy=strategy, group_size=128 if strategy == "group" else None, symmetric=True)
    cpu = algorithm.gptq_quantize(weight.clone(), hessian.clone(), args, actorder=actorder)
    gpu = algorithm.gptq_quantize(weight.cuda(), hessian.cuda(), args, actorder=actorder)
    assert gpu.loss == pytest.approx(cpu.loss, rel=1e-4)
    # float32's last bits move with the summation order; a value a grid step away is a rounding
    # that went the other way (a near tie), allowed for under 1% of the weights
    differ = float(((gpu.weight.cpu() - cpu.weight).abs() > 1e-4).float().mean())
    print(f"{strategy} actorder={actorder}: loss cpu {cpu.loss:.6g} gpu {gpu.loss:.6g}; {differ:.4%} of weights differ")
    assert differ < 0.01


def test_inner_blocks_of_a_gpu_width_are_the_same_gptq(monkeypatch):
    """On a GPU the inner blocks are 128 columns wide (one kernel launch each), on a CPU 32: the
    split changes only which updates go through rank-1 steps and which through a matrix product,
    so the loss agrees to 1e-5 and the weights to float32's last bits (a group's float32 scale is
    taken from columns updated in another order; run here with the CPU operator)."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 384, generator=g)
    x = torch.randn(1024, 384, generator=g) @ torch.randn(384, 384, generator=g) * 0.1
    hessian = 2 / 1024 * x.t() @ x
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=128, symmetric=False)
    narrow = algorithm.gptq_quantize(weight.clone(), hessian.clone(), args)
    monkeypatch.setattr(algorithm, "INNER_BLOCK", algorithm.GPU_INNER_BLOCK)
    assert algorithm._inner_blocks(0, 128, 128, algorithm.INNER_BLOCK) == [(0, 128)]
    wide = algorithm.gptq_quantize(weight.clone(), hessian.clone(), args)
    assert wide.loss == pytest.approx(narrow.loss, rel=1e-5)
    torch.testing.assert_close(wide.weight, narrow.weight, rtol=0, atol=1e-5)
    torch.testing.assert_close(wide.scale, narrow.scale, rtol=1e-5, atol=0)
