"""NVFP4, MXFP4 and FP8 block against llm-compressor 0.14: the same recipe files and tokens,
separate processes, one run; every checkpoint read back three ways.

    python bench/microscaling.py [--configs rtn-nvfp4a16 ...] [--repeat 1] [--work DIR]
    python bench/microscaling.py --decode [--work DIR]      # NVFP4A16 / MXFP4A16 speed in llmpress.load

On the shared tiny trained Llama (fp32), with lm_head dense: RTN (``QuantizationModifier``) and
GPTQ (``GPTQModifier``) with the presets ``NVFP4A16`` (fp4 e2m1 in groups of 16, fp8 group
scales under a per-tensor global scale) and ``MXFP4A16`` (groups of 32, power-of-two scales), and
RTN ``FP8_BLOCK`` (128 x 128 weight blocks, dynamic fp8 inputs per group of 128).

Each checkpoint's perplexity: ``llmpress.load`` in float32 (its dense view), transformers 5.24 +
compressed-tensors 0.20.1 in bf16, and transformers 5.17 + compressed-tensors 0.19 in bf16
(compressed-tensors decompresses fp4 weights to bf16 only: in float32 its forward fails). The
references are the fp32 model in float32 and in bf16. Last, llm-compressor's fp4 checkpoints in
``llmpress.load`` (float32) against transformers' bf16 run: relative L2 of the logits of 4 windows.

``--decode``: the random 2048-hidden Llama of ``bench/load_and_run.py`` (8 layers, TinyLlama's
shapes) as RTN NVFP4A16 and MXFP4A16 checkpoints, run by ``llmpress.load`` against the fp32 model
in float32 and bf16, each in its own process at batch 1: greedy decode tokens/s, prefill of 512
tokens, load time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from awq import read_back_perplexity
from common import work_folder
from gptq import bench_inputs, prepare_peer_runs, run_pairs
from recipes import readings, table_cells, transformers_reading

CONFIGS = {
    "rtn-nvfp4a16": ("QuantizationModifier", "NVFP4A16"),
    "rtn-mxfp4a16": ("QuantizationModifier", "MXFP4A16"),
    "gptq-nvfp4a16": ("GPTQModifier", "NVFP4A16"),
    "gptq-mxfp4a16": ("GPTQModifier", "MXFP4A16"),
    "rtn-fp8-block": ("QuantizationModifier", "FP8_BLOCK"),
}


def recipe(modifier: str, scheme: str) -> str:
    return f"quant_stage:\n  quant_modifiers:\n    {modifier}:\n      ignore: [\"lm_head\"]\n      scheme: {scheme}\n"


def logits_gap(checkpoint: Path, windows: torch.Tensor, work: Path) -> float:
    """llmpress.load (float32) against transformers 5.24 + compressed-tensors (bf16), relative L2."""
    import llmpress

    transformers_reading(Path(sys.executable), checkpoint, work / "windows.pt", "--dtype", "bfloat16", "--logits", str(work / "peer-logits.pt"))
    theirs = torch.load(work / "peer-logits.pt")
    with torch.no_grad():
        ours = llmpress.load(checkpoint, dtype=torch.float32)(input_ids=windows[:4]).logits.float()
    return float((ours - theirs).norm() / theirs.norm())


def decode_speed(work: Path) -> None:
    """Decode, prefill and load of fp4 checkpoints in llmpress.load against the dense model."""
    from load_and_run import make_random_llama, worker

    import llmpress
    from llmpress.modifiers import QuantizationModifier

    fp32 = make_random_llama(work / "random-2048")
    rows = {}
    for label, tool, model in [("fp32", "fp32", fp32), ("bf16", "bf16", fp32), ("NVFP4A16", "llmpress", work / "random-2048-nvfp4a16"),
                               ("MXFP4A16", "llmpress", work / "random-2048-mxfp4a16")]:
        if not (model / "config.json").exists():
            llmpress.oneshot(fp32, QuantizationModifier(ignore=["lm_head"], scheme=label), output_dir=model)
        load = worker("load", "--tool", tool, "--model", str(model))
        decode = worker("decode", "--tool", tool, "--model", str(model), "--new-tokens", "32")
        prefill = worker("prefill", "--tool", tool, "--model", str(model), "--tokens", "512")
        rows[label] = {**load, "tokens_per_s": decode["tokens_per_s"], "decode_rss_mb": decode["peak_rss_mb"], **prefill}
        print(json.dumps({label: rows[label]}), flush=True)
    base = rows["fp32"]
    print(f"\nrandom-2048 Llama, batch 1, {torch.get_num_threads()} threads (ratios to fp32)")
    print(f"{'':<10} {'decode tok/s':>12} {'ratio':>6} {'prefill 512 s':>13} {'ratio':>6} {'load s':>7} {'decode RSS MB':>13}")
    for label, r in rows.items():
        print(f"{label:<10} {r['tokens_per_s']:>12.1f} {r['tokens_per_s'] / base['tokens_per_s']:>5.2f}x {r['prefill_s']:>13.2f}"
              f" {base['prefill_s'] / r['prefill_s']:>5.2f}x {r['ready_s']:>7.1f} {r['decode_rss_mb']:>13.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool (the median is shown)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--decode", action="store_true", help="decode / prefill speed of fp4 checkpoints instead")
    args = parser.parse_args()
    prepare_peer_runs()
    work = work_folder(args.work, "llmpress-microscaling-")
    if args.decode:
        decode_speed(work)
        return
    models, tokens, windows = bench_inputs(work, ["tiny"])
    tiny = models["tiny"]
    torch.save(windows, work / "windows.pt")
    references = {"fp32": read_back_perplexity(tiny, windows),
                  "bf16": transformers_reading(Path(sys.executable), tiny, work / "windows.pt", "--dtype", "bfloat16")["perplexity"]}
    print(json.dumps(references), flush=True)
    rows = []
    for config in args.configs:
        path = work / f"{config}.yaml"
        path.write_text(recipe(*CONFIGS[config]))
        row = {"config": config, **run_pairs("llmpress", path, tiny, tokens, work / f"tiny-{config}", args.repeat)}
        for tool in ("llmpress", "llmcompressor"):
            checkpoint = work / f"tiny-{config}-{tool}"
            row[tool] = readings(checkpoint, windows, work / "windows.pt", "--dtype", "bfloat16")
            if tool == "llmcompressor" and "fp4" in config:
                row[tool]["logits_gap"] = logits_gap(checkpoint, windows, work)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\nreferences: fp32 {references['fp32']:.3f} (float32), {references['bf16']:.3f} (bf16)")
    header = (f"{'config':<14} {'written by':<14} {'time s':>7} {'ratio':>6} {'RSS ratio':>9} {'llmpress.load fp32':>18}"
              f" {'transformers 5.24 bf16':>22} {'5.17 + ct 0.19 bf16':>19} {'logits vs 5.24':>14}")
    print(header)
    print("-" * len(header))
    for r in rows:
        for tool, seconds, ratios, ours, theirs, theirs_peer in table_cells(r):
            gap = f"{r[tool]['logits_gap']:.2e}" if "logits_gap" in r[tool] else ""
            print(f"{r['config']:<14} {tool:<14} {seconds:>7.1f} {ratios} {ours:>18.3f} {theirs:>22} {theirs_peer:>19} {gap:>14}")
    print("\ntime: from the tool's first import to the saved checkpoint; ratios: llmpress / llm-compressor;"
          "\nperplexity: 200 windows of 256 tokens of the shared evaluation text; logits: 4 windows.")


if __name__ == "__main__":
    main()
