"""A bf16 checkpoint of SmolLM2-135M's shapes, each tool as a whole process: time, peak memory, output bytes.

    python bench/real_scale.py [--recipes fp8 w4a16 gptq] [--runs 1] [--work DIR]

A random Llama with SmolLM2-135M-Instruct's shapes (30 layers, hidden 576, MLP 1536, 9 / 3 heads,
vocab 49152, tied embeddings) saved in bf16, as real checkpoints are. Each recipe runs as the
``llmpress oneshot`` command and as llm-compressor's ``oneshot`` on the model loaded in its own
dtype (``dtype="auto"``, as its examples do), one process each, back to back (``gptq.run_pairs``:
seconds from the tool's first import to the saved checkpoint, peak RSS), and the bytes of the
written safetensors. ``fp8``: FP8_DYNAMIC;
``w4a16``: RTN W4A16 in groups of 64; ``gptq``: GPTQ W4A16 in groups of 64 on 32 x 256 tokens
of the fixture's calibration text. llmpress takes its model-free path by itself for the first
two (the recipe needs no data); ``--model-class`` makes it load the model instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import fixture, pair_cells, save_random_llama, work_folder
from gptq import calibration_tokens, pair_outputs, run_pairs

RECIPES = {
    "fp8": "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: FP8_DYNAMIC}\n",
    "w4a16": ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n      config_groups:\n"
              "        group_0:\n          targets: [Linear]\n"
              "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}\n"),
    "gptq": ("quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      ignore: [lm_head]\n      config_groups:\n"
             "        group_0:\n          targets: [Linear]\n"
             "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}\n"),
}
SAMPLES, SEQ_LEN = 32, 256


def smol_shaped(folder: Path) -> Path:
    return save_random_llama(folder, fixture("tiny-llama"), dtype="bfloat16", hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                             tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5)


def output_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["fp8", "w4a16", "gptq"], choices=sorted(RECIPES))
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--model-class", action="store_true", help="llmpress loads the model (--no-model-free)")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-real-scale-")
    model = smol_shaped(work / "smol-bf16")
    tokens = calibration_tokens(work / f"tokens-{SAMPLES}.jsonl", fixture("tiny-llama"), SAMPLES, SEQ_LEN)
    ours_tool = "llmpress-model-class" if args.model_class else "llmpress"
    rows = []
    for name in args.recipes:
        recipe = work / f"{name}.yaml"
        recipe.write_text(RECIPES[name], encoding="utf-8")
        data = tokens if name == "gptq" else Path("-")  # the data-free recipes get no data
        row = run_pairs(ours_tool, recipe, model, data, work / name, args.runs)
        ours, peer = pair_outputs(work / name, 0)
        row["bytes"] = (output_bytes(ours), output_bytes(peer))
        rows.append((name, row))
        print(json.dumps({"recipe": name, **row}), flush=True)
    print(f"\nbf16 Llama of SmolLM2-135M's shapes ({output_bytes(model) / 1e6:.0f} MB), llmpress / llm-compressor, one process each")
    print(f"{'recipe':<7} {'seconds':>20} {'peak RSS MB':>22} {'output MB':>22}")
    for name, row in rows:
        ours, peer = row["bytes"]
        print(f"{name:<7} {pair_cells(row)} {ours / 1e6:>7.2f}/{peer / 1e6:<7.2f} {ours / peer:>5.3f}")


if __name__ == "__main__":
    main()
