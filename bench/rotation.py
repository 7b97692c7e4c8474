"""Rotations before GPTQ (issue 44): the perplexity rise of each scheme with and without
``SpinQuantModifier``, on held-out text.

    python bench/rotation.py [--model DIR] [--rows w4a16 w3a16 w4a8 w4a4 nvfp4 w8a8] [--samples 64] [--seq-len 256]
                             [--rotations R1 R2] [--transform-type hadamard] [--transform-block-size N]
                             [--peer] [--peer-transform-type T]

Each row runs GPTQ on the model (default: the shared tiny trained Llama; ``--model`` a bf16
SmolLM2-135M copy, say), once alone and once after the rotations, in this process, calibrating
on ``--samples`` windows of the shared calibration text, and measures the perplexity of 40
held-out windows of 256 tokens of the shared evaluation text with the model in float32 (the
rise over the unquantized model is what a scheme costs). Weights in groups of 128 where the
columns divide, else 64; int activations dynamic per token; ``nvfp4``: the NVFP4 preset (fp4
weights and inputs in groups of 16, W4A4); ``lm_head`` left as it is.

``--peer``: llm-compressor 0.14 runs the same rows in its environment (``rotation_peer_worker.py``:
GPTQ alone, then its ``SpinQuantModifier`` + GPTQ), on the same calibration ids and windows.
Its ``hadamard`` takes powers of two only; ``--peer-transform-type random-hadamard`` for other
sizes (SmolLM2's 576).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import PEER_PYTHON, fixture

import llmpress
from llmpress.evaluation import evaluation_windows, perplexity
from llmpress.modifiers import GPTQModifier, SpinQuantModifier

ROWS = {"w4a16": (4, None), "w3a16": (3, None), "w4a8": (4, 8), "w4a4": (4, 4), "nvfp4": "NVFP4", "w8a8": (8, 8)}


def config_groups(weight_bits: int, activation_bits: int | None, group: int | None) -> dict:
    """One group on every Linear (a preset row passes ``{"preset": name}`` instead)."""
    weights = {"num_bits": weight_bits, "type": "int", "symmetric": True}
    weights.update({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})
    entry = {"targets": ["Linear"], "weights": weights}
    if activation_bits:
        entry["input_activations"] = {"num_bits": activation_bits, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}
    return {"group_0": entry}


def quantizer(groups: dict) -> GPTQModifier:
    if "preset" in groups:
        return GPTQModifier(scheme=groups["preset"], targets=["Linear"], ignore=["lm_head"])
    return GPTQModifier(config_groups=groups, ignore=["lm_head"])


def row_groups(row: str, group: int) -> dict:
    """A row's config groups (``{"preset": name}`` for a preset row); w8a8 per channel."""
    if isinstance(ROWS[row], str):
        return {"preset": ROWS[row]}
    weight_bits, activation_bits = ROWS[row]
    return config_groups(weight_bits, activation_bits, None if row == "w8a8" else group)


def prepare(model_dir: str, samples: int, seq_len: int) -> tuple[list, torch.Tensor, int, float, Path]:
    """The calibration ids and the evaluation windows of the shared text for ``model_dir``'s
    tokenizer, the group size its columns take (128, else 64), the unquantized perplexity, and a
    file holding ids and windows for a peer's worker."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(fixture("text", "calibration.txt").read_text(), add_special_tokens=False)["input_ids"]
    batches = [ids[i * seq_len:(i + 1) * seq_len] for i in range(min(samples, len(ids) // seq_len))]
    windows = evaluation_windows(fixture("text", "evaluation.txt").read_text(), tokenizer, 256, 40)
    base = load(model_dir)
    columns = {m.in_features for m in base.modules() if isinstance(m, torch.nn.Linear)}
    group = 128 if all(c % 128 == 0 for c in columns) else 64
    dense = perplexity(base, windows, progress=False).perplexity
    data = Path(tempfile.mkdtemp(prefix="bench-")) / "data.pt"
    torch.save({"batches": batches, "windows": windows}, data)
    return batches, windows, group, dense, data


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
    parser.add_argument("--transform-block-size", type=int, help="block-diagonal rotations of this size (llmpress only)")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--peer-transform-type")
    args = parser.parse_args()
    batches, windows, group, dense, data = prepare(args.model, args.samples, args.seq_len)
    print(f"{args.model}: unquantized perplexity {dense:.3f}; {len(batches)} x {args.seq_len} calibration tokens; "
          f"weights in groups of {group} (w8a8: per channel); rotations {' + '.join(args.rotations)} ({args.transform_type}"
          f"{f', blocks of {args.transform_block_size}' if args.transform_block_size else ''})")
    peer = " llm-compressor GPTQ | its SpinQuant + GPTQ | its time |" if args.peer else ""
    print(f"| scheme | GPTQ | rise | rotated + GPTQ | rise | rise cut | time GPTQ / rotated |{peer}")
    print("|---|---|---|---|---|---|---|" + "---|---|---|" * args.peer)
    for row in args.rows:
        groups = row_groups(row, group)
        figures = []
        for rotate in (False, True):
            modifiers = [SpinQuantModifier(rotations=args.rotations, transform_type=args.transform_type,
                                           transform_block_size=args.transform_block_size)] if rotate else []
            modifiers.append(quantizer(groups))
            start = time.perf_counter()
            model = llmpress.oneshot(load(args.model), modifiers, batches)
            seconds = time.perf_counter() - start
            figures.append((perplexity(model, windows, progress=False).perplexity, seconds))
        (plain, t_plain), (rotated, t_rotated) = figures
        cut = 1 - (rotated - dense) / (plain - dense) if plain > dense else math.nan
        line = (f"| {row.upper()} | {plain:.3f} | {plain - dense:+.3f} | {rotated:.3f} | {rotated - dense:+.3f} | {cut:.0%} | "
                f"{t_plain:.0f} / {t_rotated:.0f} s |")
        if args.peer:
            line += peer_cells(args, data, groups, dense)
        print(line, flush=True)


def peer_cells(args, data: Path, groups: dict, dense: float) -> str:
    command = [str(PEER_PYTHON), str(Path(__file__).with_name("rotation_peer_worker.py")), args.model, str(data),
               json.dumps(groups), ",".join(args.rotations), args.peer_transform_type or args.transform_type]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return f" failed: {done.stderr.strip().splitlines()[-1][:120]} | | |"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (plain, t_plain), rotated = result["plain"], result["rotated"]
    if isinstance(rotated, dict):
        return f" {plain:.3f} ({plain - dense:+.3f}) | {rotated['error'][:120]} | {t_plain:.0f} s |"
    return f" {plain:.3f} ({plain - dense:+.3f}) | {rotated[0]:.3f} ({rotated[0] - dense:+.3f}) | {t_plain:.0f} / {rotated[1]:.0f} s |"


if __name__ == "__main__":
    main()
