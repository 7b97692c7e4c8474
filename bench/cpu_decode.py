"""CPU decode and prefill: llmpress (dense, int8, int4) against llama.cpp's llama-bench, one run.

    python bench/cpu_decode.py [--models smol-shape random-2048 tiny] [--compile] [--work DIR]

Models, each an fp32 checkpoint that both tools start from:

- ``smol-shape``: a random Llama with SmolLM2-135M's shapes (hidden 576, 30 layers, 9 / 3 heads,
  MLP 1536, vocab 49152, tied embeddings);
- ``random-2048``: the random Llama of bench/load_and_run.py (hidden 2048, 8 layers);
- ``tiny``: the shared trained 5M-parameter Llama.

llmpress runs each variant in its own process (bench/cpu_decode_worker.py): ``fp32`` / ``bf16``
dense, ``int8`` and ``int4`` quantize-on-load (lm_head in full precision, llmpress's default;
the rest of the model in bf16 and float32), ``int4-bf16`` (int4 with the model in bf16) and
``int4-all`` (lm_head in int4 too). llama.cpp converts the same checkpoint with its own
``convert_hf_to_gguf.py`` and quantizes it to Q4_0 (which keeps the output matrix at 6 bits);
bench/llamacpp.py fetches and builds it once. Both use 2 threads, batch 1: decode is 32 tokens
from an empty context (llama-bench's tg32), prefill one 512-token prompt (pp512).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import llamacpp
from common import REPO, fixture, save_random_llama, work_folder

VARIANTS = ("fp32", "bf16", "int8", "int4", "int4-bf16", "int4-all")


def make_models(work: Path, names: list[str]) -> dict[str, Path]:
    models = {}
    for name in names:
        if name == "tiny":
            models[name] = fixture("tiny-llama")
        elif name == "random-2048":
            models[name] = save_random_llama(work / name, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
        else:  # smol-shape: tied embeddings, which save_random_llama unties
            folder = work / name
            if not (folder / "config.json").exists():
                import torch
                from transformers import LlamaConfig, LlamaForCausalLM

                torch.manual_seed(0)
                config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                                     rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
                LlamaForCausalLM(config).save_pretrained(str(folder))
            models[name] = folder
    return models


def ours(model: Path, variant: str, compile_decode: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "2"}
    command = [sys.executable, str(REPO / "bench" / "cpu_decode_worker.py"), "--model", str(model), "--variant", variant]
    if compile_decode:
        command.append("--compile")
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"llmpress {variant} on {model} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smol-shape", "random-2048", "tiny"], choices=["smol-shape", "random-2048", "tiny"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--compile", action="store_true", help="also llmpress int4-all decoding through torch.compile")
    parser.add_argument("--work", default=None, help="folder for checkpoints and llama.cpp (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "src"))
    work = work_folder(args.work, "llmpress-cpu-decode-")
    tree = llamacpp.source_tree(work)
    binaries = llamacpp.build(tree)
    from llmpress import native

    native.available()  # build llmpress's kernels once, outside the timed workers
    rows = {}
    for name, model in make_models(work, args.models).items():
        row = {"llama.cpp Q4_0": llamacpp.bench(binaries, llamacpp.gguf_q4_0(model, work, tree, binaries), 512, 32)}
        for variant in args.variants:
            row[variant] = ours(model, variant, False)
        if args.compile:
            row["int4-all compiled"] = ours(model, "int4-all", True)
        rows[name] = row
        print(json.dumps({name: row}), flush=True)

    print("\nDecode, batch 1, 2 threads: tokens/s (ratio to llama.cpp Q4_0)")
    labels = list(next(iter(rows.values())))
    print(f"{'model':<12} " + " ".join(f"{label:>20}" for label in labels))
    for name, row in rows.items():
        peer = row["llama.cpp Q4_0"]["tokens_per_s"]
        print(f"{name:<12} " + " ".join(f"{row[k]['tokens_per_s']:>10.1f} ({row[k]['tokens_per_s'] / peer:>4.2f}x)  " for k in labels))
    print("\nPrefill of 512 tokens: tokens/s (ratio to llmpress dense bf16)")
    for name, row in rows.items():
        base = row["bf16"]["prefill_tokens_per_s"] if "bf16" in row else None
        cells = []
        for k in labels:
            value = row[k]["prefill_tokens_per_s"]
            cells.append(f"{value:>10.1f} ({value / base:>4.2f}x)  " if base else f"{value:>10.1f}")
        print(f"{name:<12} " + " ".join(cells))
    print("\nllmpress: load s, which path each linear runs on, logits vs the same weights dequantized (fp32, relative L2)")
    for name, row in rows.items():
        for k in labels[1:]:
            r = row[k]
            extra = f" compile {r['compile_s']:.1f}s" if r.get("compile_s") else ""
            gap = f"{r['logits_gap']:.1e}" if "logits_gap" in r else "-"
            print(f"{name:<12} {k:<18} load {r['load_s']:>5.2f}s  gap {gap:>7}  {r['kernels']}{extra}")


if __name__ == "__main__":
    main()
