"""Rotations before GPTQ (issue 44): the perplexity rise of each scheme with and without
``SpinQuantModifier``, on held-out text.

    python bench/rotation.py [--model DIR] [--rows w4a16 w3a16 w4a8 w4a4 w8a8] [--samples 64] [--seq-len 256]
                             [--rotations R1 R2] [--transform-type hadamard]

Each row runs GPTQ on the model (default: the shared tiny trained Llama; ``--model`` a bf16
SmolLM2-135M copy, say), once alone and once after the rotations, in this process, calibrating
on ``--samples`` windows of the shared calibration text, and measures the perplexity of 40
held-out windows of 256 tokens of the shared evaluation text with the model in float32 (the
rise over the unquantized model is what a scheme costs). Weights in groups of 128 where the
columns divide, else 64; int activations dynamic per token; ``lm_head`` left as it is.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from common import fixture

import llmpress
from llmpress.evaluation import evaluation_windows, perplexity
from llmpress.modifiers import GPTQModifier, SpinQuantModifier

ROWS = {"w4a16": (4, None), "w3a16": (3, None), "w4a8": (4, 8), "w4a4": (4, 4), "w8a8": (8, 8)}


def config_groups(weight_bits: int, activation_bits: int | None, group: int | None) -> dict:
    weights = {"num_bits": weight_bits, "type": "int", "symmetric": True}
    weights.update({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})
    entry = {"targets": ["Linear"], "weights": weights}
    if activation_bits:
        entry["input_activations"] = {"num_bits": activation_bits, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}
    return {"group_0": entry}


def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(fixture("tiny-llama")))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rotations", nargs="+", default=["R1", "R2"])
    parser.add_argument("--transform-type", default="hadamard")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(fixture("text", "calibration.txt").read_text(), add_special_tokens=False)["input_ids"]
    batches = [ids[i * args.seq_len:(i + 1) * args.seq_len] for i in range(min(args.samples, len(ids) // args.seq_len))]
    windows = evaluation_windows(fixture("text", "evaluation.txt").read_text(), tokenizer, 256, 40)
    base = load(args.model)
    columns = {m.in_features for m in base.modules() if isinstance(m, torch.nn.Linear)}
    group = 128 if all(c % 128 == 0 for c in columns) else 64
    dense = perplexity(base, windows, progress=False).perplexity
    print(f"{args.model}: unquantized perplexity {dense:.3f}; {len(batches)} x {args.seq_len} calibration tokens; "
          f"weights in groups of {group} (w8a8: per channel); rotations {' + '.join(args.rotations)} ({args.transform_type})")
    print("| scheme | GPTQ | rise | rotated + GPTQ | rise | rise cut | time GPTQ / rotated |")
    print("|---|---|---|---|---|---|---|")
    for row in args.rows:
        weight_bits, activation_bits = ROWS[row]
        groups = config_groups(weight_bits, activation_bits, None if row == "w8a8" else group)
        figures = []
        for rotate in (False, True):
            modifiers = [SpinQuantModifier(rotations=args.rotations, transform_type=args.transform_type)] if rotate else []
            modifiers.append(GPTQModifier(config_groups=groups, ignore=["lm_head"]))
            start = time.perf_counter()
            model = llmpress.oneshot(load(args.model), modifiers, batches)
            seconds = time.perf_counter() - start
            figures.append((perplexity(model, windows, progress=False).perplexity, seconds))
        (plain, t_plain), (rotated, t_rotated) = figures
        cut = 1 - (rotated - dense) / (plain - dense) if plain > dense else math.nan
        print(f"| {row.upper()} | {plain:.3f} | {plain - dense:+.3f} | {rotated:.3f} | {rotated - dense:+.3f} | {cut:.0%} | "
              f"{t_plain:.0f} / {t_rotated:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
