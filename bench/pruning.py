"""One-shot pruning against llm-compressor 0.14: SparseGPT and Wanda, the same recipe file, the
same tokens, separate processes, one run.

    python bench/pruning.py [--models tiny random-1024] [--configs sparsegpt-2:4 ...] [--repeat 1] [--work DIR]

Recipes, as llm-compressor's examples write them: ``SparseGPTModifier`` or ``WandaPruningModifier``
with ``sparsity: 0.5`` and ``mask_structure`` ``"2:4"`` or ``"0:0"`` (unstructured), lm_head left
dense. Each checkpoint is read back through transformers (dense weights, ``sparsity_config``
beside them): perplexity on the trained tiny model, and the share of zeros in its pruned
Linears; on the random hidden-1024 Llama only time and memory mean anything. Ratios are
llmpress / llm-compressor, medians over pairs of runs made back to back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import pair_cells, work_folder
from gptq import bench_inputs, pair_outputs, prepare_peer_runs, run_pairs, transformers_perplexity

CONFIGS = {
    "sparsegpt-2:4": ("SparseGPTModifier", "2:4"),
    "sparsegpt-2:4+gptq": ("SparseGPTModifier", "2:4"),  # then a GPTQ W4A16 stage
    "sparsegpt-0.5": ("SparseGPTModifier", "0:0"),
    "wanda-2:4": ("WandaPruningModifier", "2:4"),
    "wanda-0.5": ("WandaPruningModifier", "0:0"),
}


def pruning_recipe(path: Path, modifier: str, structure: str, then_gptq: bool = False) -> Path:
    gptq = """quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
"""
    path.write_text(f"""sparsity_stage:
  sparsity_modifiers:
    {modifier}:
      sparsity: 0.5
      mask_structure: "{structure}"
      targets: ["Linear"]
      ignore: ["re:.*lm_head"]
""" + (gptq if then_gptq else ""))
    return path


def zeros_of(checkpoint: Path) -> tuple[float, float]:
    """Over the checkpoint's layers' projections, read through their exact dense view: the share
    of zeros, and the share of groups of 4 inputs with at least 2 of them zero (1.0: 2:4)."""
    import llmpress

    model = llmpress.load(checkpoint, dequantize=True, dtype=torch.float32)
    weights = [m.weight for n, m in model.named_modules() if "layers." in n and n.endswith("proj")]
    zeros = sum(int((w == 0).sum()) for w in weights) / max(sum(w.numel() for w in weights), 1)
    groups = torch.cat([((w.reshape(-1, 4) == 0).sum(-1) >= 2).float() for w in weights])
    return zeros, float(groups.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "random-1024"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool (the median is shown)")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    prepare_peer_runs()
    work = work_folder(args.work, "llmpress-pruning-")
    models, tokens, windows = bench_inputs(work, args.models)
    fp32 = transformers_perplexity(models["tiny"], windows)
    rows = []
    for name in args.models:
        for config in args.configs if name == "tiny" else args.configs[:1]:
            modifier, structure = CONFIGS[config]
            recipe = pruning_recipe(work / f"{config.replace(':', '-')}.yaml", modifier, structure, then_gptq=config.endswith("gptq"))
            output = work / f"{name}-{config.replace(':', '-')}"
            row = {"model": name, "config": config, **run_pairs("llmpress", recipe, models[name], tokens, output, args.repeat)}
            if name == "tiny":
                ours, peer = pair_outputs(output, 0)
                row["ppl_ours"], row["ppl_peer"] = transformers_perplexity(ours, windows), transformers_perplexity(peer, windows)
                row["zeros_ours"], row["zeros_peer"] = zeros_of(ours), zeros_of(peer)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nOne-shot pruning, 64 x 256 calibration tokens, lm_head dense; fp32 perplexity of tiny-llama {fp32:.3f}")
    header = (f"{'model':<12} {'config':>19} {'in-process s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6}"
              f" {'ppl llmpress':>12} {'ppl llm-c':>9} {'zeros':>11} {'2:4 groups':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['model']:<12} {r['config']:>19} {pair_cells(r)}"
        if "ppl_ours" in r:
            (zo, go), (zp, gp) = r["zeros_ours"], r["zeros_peer"]
            line += f" {r['ppl_ours']:>12.3f} {r['ppl_peer']:>9.3f} {zo:.3f}/{zp:.3f} {go:.3f}/{gp:.3f}"
        print(line)
    print("\nin-process: from the tool's first import to the saved checkpoint; ratios: llmpress / llm-compressor;"
          "\nperplexity through transformers (200 windows of 256 tokens); zeros: share of zeros in the layers' projections;"
          "\n2:4 groups: share of their groups of 4 inputs with 2 or more zeros (1.000: the 2:4 pattern sparse kernels need).")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
