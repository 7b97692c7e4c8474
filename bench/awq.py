"""AWQ against llm-compressor 0.14: same recipe file, same tokens, separate processes, one run.

    python bench/awq.py [--models tiny random-1024] [--configs w4 w3 w3-asym] [--repeat 1] [--work DIR]
    python bench/awq.py --models tiny --orders 4      # perplexity over 4 orders of the calibration samples
    python bench/awq.py --models tiny --every-token   # llmpress scoring on every token, as llm-compressor

The recipe is llm-compressor's AWQ example: ``AWQModifier`` (duo scaling, a grid of 20) followed by
a ``QuantizationModifier`` giving the scheme (int weights in groups of 128, lm_head dense). On the
trained tiny model each checkpoint's perplexity is read back through its exact dense view
(``llmpress.load(..., dequantize=True)``), beside plain RTN with the same scheme; on the random
hidden-1024 Llama only time and memory mean anything. Ratios are llmpress / llm-compressor,
medians over pairs of runs made back to back.

``--orders N`` runs N pairs on the tiny model, each on another order of the calibration samples
(``gptq.calibration_orders``), and reads every checkpoint: llm-compressor shuffles the samples in
every run, and its AWQ perplexity moves by a few hundredths with the order, so its median over N
orders is what llmpress's figure is set against.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import pair_cells, work_folder
from gptq import bench_inputs, calibration_orders, pair_outputs, prepare_peer_runs, rtn_perplexity, run_pairs

CONFIGS = {"w4": (4, True), "w3": (3, True), "w3-asym": (3, False)}


def awq_recipe(path: Path, bits: int, symmetric: bool, clip: bool = False, every_token: bool = False) -> Path:
    # llmpress's additions (llm-compressor has no such fields): the clipping search, and scoring
    # every candidate on every calibration token (llm-compressor's way) instead of a spread of 4096
    extra = ("      apply_clip: true\n" if clip else "") + ("      search_tokens: null\n" if every_token else "")
    path.write_text(f"""quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: true
      n_grid: 20
{extra}    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: {bits}, type: int, symmetric: {str(symmetric).lower()}, strategy: group, group_size: 128}}
""")
    return path


def read_back_perplexity(checkpoint: Path, windows) -> float:
    """Through ``llmpress.load(..., dequantize=True)``: the exact dense view, equal to
    transformers + compressed-tensors where those read the checkpoint (they do not read packed
    asymmetric zero points, an upstream mismatch)."""
    import llmpress
    from llmpress.evaluation import perplexity

    return perplexity(llmpress.load(checkpoint, dequantize=True, dtype=torch.float32), windows, progress=False).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "random-1024"], choices=["tiny", "random-1024"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool (the median is shown)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--clip", action="store_true", help="llmpress with apply_clip: true (its clipping search); llm-compressor as before")
    parser.add_argument("--every-token", action="store_true",
                        help="llmpress with search_tokens: null (every candidate scored on every token, as llm-compressor)")
    parser.add_argument("--orders", type=int, default=1,
                        help="tiny model: N pairs, each on another order of the calibration samples; every checkpoint is read")
    args = parser.parse_args()
    prepare_peer_runs()
    work = work_folder(args.work, "llmpress-awq-")
    models, tokens, windows = bench_inputs(work, args.models)
    tiny = models["tiny"]
    fp32 = read_back_perplexity(tiny, windows)  # a plain checkpoint loads as it is
    rows = []
    for name in args.models:
        for config in args.configs if name == "tiny" else args.configs[:1]:
            bits, symmetric = CONFIGS[config]
            recipe = awq_recipe(work / f"awq-{config}.yaml", bits, symmetric)
            ours_recipe = (awq_recipe(work / f"awq-{config}-ours.yaml", bits, symmetric, clip=args.clip, every_token=args.every_token)
                           if args.clip or args.every_token else recipe)
            orders = calibration_orders(tokens, args.orders) if name == "tiny" and args.orders > 1 else [tokens]
            output = work / f"{name}-{config}"
            row = {"model": name, "config": config + ("+clip" if args.clip else "") + ("+all" if args.every_token else ""),
                   **run_pairs("llmpress", ours_recipe, models[name], orders, output, max(args.repeat, len(orders)), peer_recipe=recipe)}
            if name == "tiny":
                read = [[read_back_perplexity(path, windows) for path in pair_outputs(output, i)] for i in range(len(orders))]
                row["orders"] = {"ours": [r[0] for r in read], "peer": [r[1] for r in read]}
                row["ppl_ours"], row["ppl_peer"] = (statistics.median(p) for p in row["orders"].values())
                row["ppl_rtn"] = rtn_perplexity(tiny, bits, windows, symmetric)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nAWQ + RTN, 64 x 256 calibration tokens, group 128; fp32 perplexity of tiny-llama {fp32:.3f}")
    header = (f"{'model':<12} {'config':>8} {'in-process s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6}"
              f" {'ppl llmpress':>12} {'ppl llm-c':>9} {'ppl RTN':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['model']:<12} {r['config']:>8} {pair_cells(r)}"
        if "ppl_ours" in r:
            line += f" {r['ppl_ours']:>12.3f} {r['ppl_peer']:>9.3f} {r['ppl_rtn']:>8.3f}"
        print(line)
    print("\nin-process: from the tool's first import to the saved checkpoint; ratios: llmpress / llm-compressor;"
          "\nperplexities of the saved checkpoints through llmpress.load(dequantize=True) (200 windows of 256 tokens)"
          + (f", medians over {args.orders} calibration orders" if args.orders > 1 else "") + ".")
    if args.orders > 1:
        print(f"\nperplexity over {args.orders} calibration orders: median [min, max]")
        for r in (r for r in rows if "orders" in r):
            cells = [f"{tool} {statistics.median(p):.3f} [{min(p):.3f}, {max(p):.3f}]"
                     for tool, p in (("llmpress", r["orders"]["ours"]), ("llm-compressor", r["orders"]["peer"]))]
            print(f"{r['config']:>8}   " + "   ".join(cells))


if __name__ == "__main__":
    main()
