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
from common import work_folder
from gptq import bench_inputs, pair_outputs, prepare_peer_runs, run_pairs, transformers_perplexity

CONFIGS = {
    "sparsegpt-2:4": ("SparseGPTModifier", "2:4"),
    "sparsegpt-0.5": ("SparseGPTModifier", "0:0"),
    "wanda-2:4": ("WandaPruningModifier", "2:4"),
    "wanda-0.5": ("WandaPruningModifier", "0:0"),
}


def pruning_recipe(path: Path, modifier: str, structure: str) -> Path:
    path.write_text(f"""sparsity_stage:
  sparsity_modifiers:
    {modifier}:
      sparsity: 0.5
      mask_structure: "{structure}"
      targets: ["Linear"]
      ignore: ["re:.*lm_head"]
""")
    return path


def zeros_of(checkpoint: Path) -> float:
    """The share of zeros over the checkpoint's pruned Linears (its layers' projections)."""
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(str(checkpoint / "model.safetensors")).items() if "layers." in k and k.endswith("proj.weight")}
    return sum(int((t == 0).sum()) for t in tensors.values()) / max(sum(t.numel() for t in tensors.values()), 1)


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
            recipe = pruning_recipe(work / f"{config.replace(':', '-')}.yaml", modifier, structure)
            output = work / f"{name}-{config.replace(':', '-')}"
            row = {"model": name, "config": config, **run_pairs("llmpress", recipe, models[name], tokens, output, args.repeat)}
            if name == "tiny":
                ours, peer = pair_outputs(output, 0)
                row["ppl_ours"], row["ppl_peer"] = transformers_perplexity(ours, windows), transformers_perplexity(peer, windows)
                row["zeros_ours"], row["zeros_peer"] = zeros_of(ours), zeros_of(peer)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nOne-shot pruning, 64 x 256 calibration tokens, lm_head dense; fp32 perplexity of tiny-llama {fp32:.3f}")
    header = (f"{'model':<12} {'config':>14} {'in-process s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6}"
              f" {'ppl llmpress':>12} {'ppl llm-c':>9} {'zeros':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        o, p, q = r["ours"], r["peer"], r["ratios"]
        line = (f"{r['model']:<12} {r['config']:>14} {o['compress_s']:>6.1f}/{p['compress_s']:<6.1f} {q['compress_s']:>6.2f}"
                f" {o['rss_mb']:>7.0f}/{p['rss_mb']:<7.0f} {q['rss_mb']:>6.2f}")
        if "ppl_ours" in r:
            line += f" {r['ppl_ours']:>12.3f} {r['ppl_peer']:>9.3f} {r['zeros_ours']:.3f}/{r['zeros_peer']:.3f}"
        print(line)
    print("\nin-process: from the tool's first import to the saved checkpoint; ratios: llmpress / llm-compressor;"
          "\nperplexity through transformers (200 windows of 256 tokens); zeros: share of zeros in the layers' projections.")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
