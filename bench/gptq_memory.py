"""GPTQ's peak memory against the size of the model it compresses: does it stream?

    python bench/gptq_memory.py [--layers 4 8 16] [--dtype bfloat16] [--work DIR]

Random Llamas of hidden 2048 (MLP 5632, 32 / 4 heads, vocab 32000: TinyLlama-1.1B's shapes) with
more and more layers, each saved as fp32 (or ``--dtype bfloat16``) safetensors, compressed by the ``llmpress oneshot``
command (GPTQ W4A16, group 128, lm_head dense) on 64 x 256 calibration tokens, each in its own
process (bench/gptq_worker.py): peak RSS (VmHWM) as a fraction of the fp32 file. A pipeline that
holds the model grows with it (a fraction near or above 1); one that streams holds about one
layer plus the activations in flight, so its fraction falls as the model gets deeper.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import fixture, save_random_llama, work_folder
from gptq import calibration_tokens, gptq_recipe, run_worker


def random_llama(folder: Path, layers: int, dtype: str = "float32") -> Path:
    return save_random_llama(folder, dtype=dtype, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--work", default=None, help="folder for models and checkpoints (default: a temporary folder)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the dtype the models are saved in")
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-gptq-memory-")
    tokens = calibration_tokens(work / "tokens.jsonl", fixture("tiny-llama"))
    recipe = gptq_recipe(work / "gptq-w4.yaml", 4)
    rows = []
    for layers in args.layers:
        suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
        model = random_llama(work / f"random-2048-{layers}{suffix}", layers, args.dtype)  # kept in --work: made once
        size_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        run = run_worker(Path(sys.executable), "llmpress", recipe, model, tokens, work / f"random-2048-{layers}{suffix}-w4")
        rows.append({"layers": layers, "file_mb": size_mb, **run, "fraction": run["rss_mb"] / size_mb})
        print(json.dumps(rows[-1]), flush=True)
    print("\nGPTQ W4A16 (llmpress oneshot), 64 x 256 calibration tokens, random Llama of hidden 2048")
    print(f"{'layers':>6} {args.dtype + ' file MB':>13} {'peak RSS MB':>12} {'RSS / file':>11} {'wall s':>8}")
    for row in rows:
        print(f"{row['layers']:>6} {row['file_mb']:>13.0f} {row['rss_mb']:>12.0f} {row['fraction']:>11.2f} {row['wall_s']:>8.1f}")


if __name__ == "__main__":
    main()
