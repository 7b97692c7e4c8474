"""The Hessians' ``X^T X`` of bf16 inputs on AMX or AVX-512 BF16 (native/gram.cpp, amx.cpp): the
sums of the float32 route, the same bits however the sequences are batched or the threads split,
either kernel, and the accumulator using it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from llmpress import native
from llmpress.modifiers.hessians import HessianAccumulator

pytestmark = pytest.mark.skipif(
    not (native.available() and {"avx512_bf16", "avx512bw"} <= native.cpu_flags()), reason="needs AVX-512 BF16 and llmpress's CPU operators"
)


def _blocks(columns: int, height: int) -> tuple[list[torch.Tensor], list[int]]:
    edges = [*range(0, columns, height), columns]
    return [torch.zeros(end - start, columns - start, dtype=torch.float64) for start, end in zip(edges, edges[1:])], edges[:-1]


@pytest.mark.parametrize(("sequences", "tokens", "columns", "height"), [(2, 64, 200, 128), (3, 7, 40, 16), (1, 5, 77, 77), (2, 1, 19, 6)])
def test_sums_are_the_float32_products(sequences, tokens, columns, height):
    """Every shape edge: odd token counts (the last pair half empty), columns not a multiple of
    16 or 64, blocks whose rows are not a multiple of the tile's 6."""
    torch.manual_seed(0)
    x = torch.randn(sequences, tokens, columns).to(torch.bfloat16)
    blocks, starts = _blocks(columns, height)
    assert native.add_gram_bf16_(blocks, starts, x)
    exact = sum(s.T @ s for s in x.double())
    for block, start in zip(blocks, starts):
        expected = exact[start : start + block.shape[0], start:]
        torch.testing.assert_close(block, expected, rtol=1e-6, atol=1e-5 * exact.abs().max().item())


def test_same_bits_whatever_the_batching_and_threads():
    torch.manual_seed(1)
    x = torch.randn(4, 50, 130).to(torch.bfloat16)
    together, starts = _blocks(130, 64)
    native.add_gram_bf16_(together, starts, x)
    one_by_one, _ = _blocks(130, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for sequence in x.split(1):
            native.add_gram_bf16_(one_by_one, starts, sequence)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(together, one_by_one):
        assert torch.equal(a, b)


def test_declines_what_it_does_not_take():
    blocks, starts = _blocks(16, 16)
    assert not native.add_gram_bf16_(blocks, starts, torch.randn(1, 4, 16))  # float32 inputs: the caller multiplies
    assert torch.count_nonzero(blocks[0]) == 0


def test_accumulator_matches_the_float32_route():
    """HessianAccumulator on bf16 inputs gives the Hessian of their float32 conversion."""
    torch.manual_seed(2)
    x = torch.randn(3, 32, 600).to(torch.bfloat16)  # over two triangle blocks: the row-block layout
    bf16, f32 = HessianAccumulator(600, torch.device("cpu")), HessianAccumulator(600, torch.device("cpu"))
    bf16.add(x)
    f32.add(x.float())
    torch.testing.assert_close(bf16.result(), f32.result(), rtol=1e-5, atol=1e-4)


AVX512_TILES = """
import sys, torch
from llmpress import native
x = torch.load(sys.argv[1])
blocks = [torch.zeros(96, 150, dtype=torch.float64), torch.zeros(54, 54, dtype=torch.float64)]
assert native.add_gram_bf16_(blocks, [0, 96], x)
torch.save(blocks, sys.argv[1])
"""


def test_without_amx_the_avx512_tiles_give_the_same_sums(tmp_path):
    """``LLMPRESS_AMX=0`` (a CPU without AMX takes the same route): the AVX-512 BF16 tiles, in a
    process of their own (the switch is read once), agree with this process's kernel (AMX where
    the CPU has it) to float32's precision."""
    torch.manual_seed(3)
    x = torch.randn(2, 41, 150).to(torch.bfloat16)
    torch.save(x, tmp_path / "case.pt")
    env = {**os.environ, "LLMPRESS_AMX": "0", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", AVX512_TILES, str(tmp_path / "case.pt")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    here = [torch.zeros(96, 150, dtype=torch.float64), torch.zeros(54, 54, dtype=torch.float64)]
    assert native.add_gram_bf16_(here, [0, 96], x)
    exact = sum(s.T @ s for s in x.double())
    scale = exact.abs().max().item()
    for theirs, ours, start in zip(torch.load(tmp_path / "case.pt"), here, [0, 96]):
        torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-5 * scale)
        torch.testing.assert_close(ours, exact[start : start + ours.shape[0], start:], rtol=1e-6, atol=1e-5 * scale)
