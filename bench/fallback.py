"""The path of integer grids no integer kernel takes, against dense bf16 and float32 products.

    python bench/fallback.py [--rows 5632] [--columns 2000] [--group 40]

A 4-bit weight in groups of 40 columns (no kernel group divides 40 exactly) runs on ``bf16``: its
weight dequantized once in bf16. Beside it: the same module dequantizing on every call (the
``dequant`` path, what such grids ran on before), and dense ``nn.Linear`` products in bf16 and
float32. Decode (1 token) and prefill (512 tokens), 2 threads, medians of alternating repeats.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from llmpress.quant import QuantizationScheme
from llmpress.runtime import QuantizedLinear


def medians(fns, repeat: int) -> list[float]:
    """Median seconds of each function, the functions alternating (this VM drifts between runs)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [sorted(spent)[len(spent) // 2] for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5632)
    parser.add_argument("--columns", type=int, default=2000)
    parser.add_argument("--group", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    scheme = QuantizationScheme.model_validate(
        {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": args.group, "symmetric": True}})
    module = QuantizedLinear(args.columns, args.rows, scheme)
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (args.rows, args.columns), dtype=torch.int8, generator=generator)
    module.load_quantized(q, torch.rand(args.rows, args.columns // args.group, generator=generator) * 1e-2 + 1e-3)
    weight = module.dequantized_weight(torch.float32)
    dense_bf16 = weight.to(torch.bfloat16)
    print(f"{args.rows} x {args.columns}, 4-bit groups of {args.group}: kernel {module.kernel}")
    print(f"{'tokens':>7} {'x in':>5} {'bf16 path':>10} {'dequantize each call':>21} {'dense bf16':>11} {'dense fp32':>11}   (ms; dense bf16 / path)")
    with torch.no_grad():
        for tokens, repeat in ((1, 50), (512, 7)):
            x = torch.randn(1, tokens, args.columns, generator=generator)
            xb = x.to(torch.bfloat16)
            for inputs in (xb, x):
                path, per_call, bf16, fp32 = medians([
                    lambda: module(inputs),
                    lambda: F.linear(inputs, module.dequantized_weight(inputs.dtype)),
                    lambda: F.linear(xb, dense_bf16),
                    lambda: F.linear(x, weight),
                ], repeat)
                name = str(inputs.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
                print(f"{tokens:>7} {name:>5} {path * 1e3:>10.2f} {per_call * 1e3:>21.2f} {bf16 * 1e3:>11.2f} {fp32 * 1e3:>11.2f}   {bf16 / path:.2f}x")


if __name__ == "__main__":
    main()
