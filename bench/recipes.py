"""SmoothQuant + GPTQ W8A8 and the fp8 KV cache against llm-compressor 0.14: the same recipe
files, the same tokens, separate processes, one run.

    python bench/recipes.py [--configs sq-gptq-w8a8 gptq-w8a8 kv-fp8] [--repeat 1] [--work DIR]
    python bench/recipes.py --configs sq-gptq-w8a8 --models random-1024     # where the work dominates
    python bench/recipes.py --configs sq-gptq-w8a8 --orders 8              # perplexity over 8 calibration orders

Models: the shared tiny trained Llama, and the same model with activation outliers (a few
channels of each norm x50 and the Linears reading them /50: the same function, the activations of
models with massive activations), where SmoothQuant has something to move. Recipes, as
llm-compressor's examples write them:

- ``sq-gptq-w8a8``: ``SmoothQuantModifier`` (strength 0.8) then ``GPTQModifier`` with ``W8A8``
  (int8 weights per channel, int8 inputs per token, dynamic), lm_head dense;
- ``gptq-w8a8``: the same without SmoothQuant (what SmoothQuant buys);
- ``kv-fp8``: ``QuantizationModifier`` with only ``kv_cache_scheme`` (fp8 e4m3, per tensor, static).

Each checkpoint's perplexity is read three ways: ``llmpress.load(dequantize=True)``;
transformers + compressed-tensors at llmpress's pins; and at llm-compressor's (transformers 5.17 +
compressed-tensors 0.19, its own environment). The last column says whether that loader
registered the KV-cache scales. ``--models random-1024`` runs a config on the random hidden-1024
Llama of the GPTQ bench instead, where time and memory are what mean something.

``--orders N`` runs N pairs, each on another order of the calibration samples, and reads every
checkpoint: at W8A8 the order alone moves llm-compressor's perplexity by a few thousandths (its
GPTQ's float sums round differently, and per-token int8 inputs pass that on), so one of its runs
says little at that level; its median over N orders does. llmpress's is the same for every order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from awq import read_back_perplexity
from common import PEER_PYTHON, REPO, fixture, work_folder
from gptq import bench_inputs, calibration_orders, pair_outputs, prepare_peer_runs, run_pairs

KV = "{num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}"
RECIPES = {
    "sq-gptq-w8a8": """quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: W8A8
""",
    "gptq-w8a8": """quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      scheme: W8A8
""",
    "kv-fp8": f"""quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme: {KV}
""",
}
MODELS = {"sq-gptq-w8a8": ["tiny", "tiny-outliers"], "gptq-w8a8": ["tiny-outliers"], "kv-fp8": ["tiny"]}


def save_outlier_model(folder: Path) -> Path:
    """The tiny trained Llama with channels 3, 17, 40, 77 of every norm x50 and the q/k/v,
    gate/up weights reading them /50."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return folder
    tiny = fixture("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    channels = torch.tensor([3, 17, 40, 77])
    with torch.no_grad():
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for norm, readers in ((layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                                  (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                norm.weight[channels] *= 50
                for linear in readers:
                    linear.weight[:, channels] /= 50
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(str(folder))
    return folder


def transformers_reading(python: Path, checkpoint: Path, windows: Path, *options: str) -> dict:
    """Perplexity through transformers + compressed-tensors in ``python``'s environment
    (``options``: the worker's ``--dtype``, ``--logits``), or the error it ended with."""
    env = {**os.environ, "PYTHONPATH": "", "TQDM_DISABLE": "1"}
    result = subprocess.run([str(python), str(REPO / "bench" / "perplexity_worker.py"), str(checkpoint), str(windows), *options],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1][:120]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def readings(checkpoint: Path, windows, windows_file: Path, *options: str) -> dict:
    """A checkpoint's perplexity in its three readers: ``llmpress.load``, transformers at our
    pins, transformers at llm-compressor's (``options``: the worker's, e.g. ``--dtype``)."""
    return {"llmpress.load": read_back_perplexity(checkpoint, windows),
            "transformers": transformers_reading(Path(sys.executable), checkpoint, windows_file, *options),
            "transformers-peer": transformers_reading(PEER_PYTHON, checkpoint, windows_file, *options)}


def table_cells(row: dict) -> list[tuple]:
    """For each tool's line of a pair's row: tool, seconds, the ratio cells (llmpress's line only),
    perplexity in llmpress.load, in transformers at llmpress's pins and at llm-compressor's."""
    cells = []
    for tool, side in (("llmpress", "ours"), ("llmcompressor", "peer")):
        read = row[tool]
        ppl = [f"{read[k]['perplexity']:.3f}" if "perplexity" in read[k] else "fails" for k in ("transformers", "transformers-peer")]
        ratios = f"{row['ratios']['compress_s']:>6.2f} {row['ratios']['rss_mb']:>9.2f}" if side == "ours" else f"{'':>6} {'':>9}"
        cells.append((tool, row[side]["compress_s"], ratios, read["llmpress.load"], *ppl))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--repeat", type=int, default=1, help="runs per tool (the median is shown)")
    parser.add_argument("--orders", type=int, default=1,
                        help="N pairs, each on another order of the calibration samples; every checkpoint's perplexity is read")
    parser.add_argument("--work", default=None)
    parser.add_argument("--models", nargs="+", default=None, choices=["tiny", "tiny-outliers", "random-1024"],
                        help="the models to run each config on (default: the tiny ones each config is meant for)")
    args = parser.parse_args()
    prepare_peer_runs()
    work = work_folder(args.work, "llmpress-recipes-")
    models, tokens, windows = bench_inputs(work, args.models or ["tiny"])
    models["tiny-outliers"] = save_outlier_model(work / "tiny-outliers")
    torch.save(windows, work / "windows.pt")

    fp32 = {name: read_back_perplexity(path, windows) for name, path in models.items()}
    rows = []
    for config in args.configs:
        recipe = work / f"{config}.yaml"
        recipe.write_text(RECIPES[config])
        for name in args.models or MODELS[config]:
            output = work / f"{name}-{config}"
            orders = calibration_orders(tokens, args.orders) if args.orders > 1 else tokens
            row = {"config": config, "model": name, **run_pairs("llmpress", recipe, models[name], orders, output, max(args.repeat, args.orders))}
            for tool, checkpoint in zip(("llmpress", "llmcompressor"), pair_outputs(output, 0)):
                row[tool] = readings(checkpoint, windows, work / "windows.pt")
            row["orders"] = {tool: [row[tool]["llmpress.load"]] + [read_back_perplexity(pair_outputs(output, i)[side], windows)
                                                                   for i in range(1, args.orders)]
                             for side, tool in enumerate(("llmpress", "llmcompressor"))}
            rows.append(row)
            print(json.dumps(row), flush=True)

    print("\nfp32 perplexity: " + ", ".join(f"{n} {p:.3f}" for n, p in fp32.items()))
    header = (f"{'config':<13} {'model':<14} {'written by':<14} {'in-process s':>13} {'ratio':>6} {'RSS ratio':>9}"
              f" {'ppl llmpress.load':>17} {'transformers 5.24':>17} {'5.17 + ct 0.19':>15} {'kv scales':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        for tool, seconds, ratios, ours, theirs, theirs_peer in table_cells(r):
            scales = "yes" if r[tool]["transformers-peer"].get("kv_scales") else "no"
            print(f"{r['config']:<13} {r['model']:<14} {tool:<14} {seconds:>13.1f} {ratios} {ours:>17.3f}"
                  f" {theirs:>17} {theirs_peer:>15} {scales:>9}")
    print("\nin-process: from the tool's first import to the saved checkpoint; ratios: llmpress / llm-compressor;"
          "\nperplexity: 200 windows of 256 tokens of the shared evaluation text.")
    if args.orders > 1:
        print(f"\nperplexity (llmpress.load) over {args.orders} calibration orders: median [min, max]")
        for r in rows:
            cells = [f"{tool} {statistics.median(p):.4f} [{min(p):.4f}, {max(p):.4f}]" for tool, p in r["orders"].items()]
            print(f"{r['config']:<13} {r['model']:<14} " + "   ".join(cells))


if __name__ == "__main__":
    main()
