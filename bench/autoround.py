"""AutoRound against GPTQ and against llm-compressor's AutoRound (issue 44): perplexity on
held-out text, and each tool's time.

    python bench/autoround.py [--model DIR] [--rows w4a16 w3a16 w4a8 nvfp4] [--samples 64] [--seq-len 256]
                              [--iters 200] [--batch-size 8] [--peer] [--package] [--no-gptq] [--peers-only]

Each row quantizes a fresh float32 copy of the model (default: the shared tiny trained Llama;
``--model`` a bf16 SmolLM2-135M copy, say, loaded in float32 as the peer loads it) with
llmpress's GPTQ and its ``AutoRoundModifier``, calibrating on ``--samples`` windows of the shared
calibration text, and measures the perplexity of 40 held-out windows of 256 tokens of the shared
evaluation text. Weights symmetric in groups of 128 where the columns divide, else 64; int
activations dynamic per token; ``nvfp4``: the NVFP4 preset; ``lm_head`` left as it is.

``--peer``: llm-compressor 0.14's ``AutoRoundModifier`` (auto-round 0.15 underneath) runs the
same row in its environment (``autoround_peer_worker.py``) on the same ids, iterations and batch
size; ``--package``: the ``auto-round`` package's own ``AutoRound`` entry point does
(``autoround_package_worker.py``; weight-only and preset rows). Times are each tool's ``oneshot`` in its process (auto-round runs its loop in bf16 under
autocast where the CPU has bf16 units, and compiles it; llmpress runs the model's dtype, eagerly).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from common import PEER_PYTHON, fixture
from rotation import ROWS, load, prepare, quantizer, row_groups

import llmpress
from llmpress.evaluation import perplexity
from llmpress.modifiers import AutoRoundModifier


def autoround(groups: dict, iters: int, batch_size: int) -> AutoRoundModifier:
    fields = dict(iters=iters, batch_size=batch_size, ignore=["lm_head"])
    if "preset" in groups:
        return AutoRoundModifier(scheme=groups["preset"], targets=["Linear"], **fields)
    return AutoRoundModifier(config_groups=groups, **fields)


def peer_cells(args, data: Path, groups: dict, dense: float, worker: str = "autoround_peer_worker.py") -> str:
    command = [str(PEER_PYTHON), str(Path(__file__).with_name(worker)), args.model, str(data),
               json.dumps(groups), str(args.iters), str(args.batch_size)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return f" failed: {done.stderr.strip().splitlines()[-1][:120]} | |"
    value, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return f" {value:.3f} ({value - dense:+.3f}) | {seconds:.0f} s |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(fixture("tiny-llama")))
    parser.add_argument("--rows", nargs="+", default=["w4a16", "w3a16", "w4a8", "nvfp4"], choices=list(ROWS))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--peer", action="store_true", help="llm-compressor's AutoRoundModifier on the same rows")
    parser.add_argument("--package", action="store_true", help="the auto-round package's own AutoRound on the same rows")
    parser.add_argument("--no-gptq", action="store_true", help="skip llmpress's GPTQ column")
    parser.add_argument("--peers-only", action="store_true", help="skip llmpress's columns (the peers' runs only)")
    args = parser.parse_args()
    batches, windows, group, dense, data = prepare(args.model, args.samples, args.seq_len)
    print(f"{args.model}: unquantized perplexity {dense:.3f}; {len(batches)} x {args.seq_len} calibration tokens; "
          f"weights in groups of {group}; AutoRound {args.iters} steps of {args.batch_size} samples")
    peer = " llm-compressor AutoRound | its time |" if args.peer else ""
    peer += " auto-round package | its time |" if args.package else ""
    print(f"| scheme | GPTQ | AutoRound | rise, GPTQ / AutoRound | time GPTQ / AutoRound |{peer}")
    print("|---|---|---|---|---|" + "---|---|" * (args.peer + args.package))
    for row in args.rows:
        groups = row_groups(row, group)
        modifiers = {"gptq": None if args.no_gptq or args.peers_only else quantizer(groups),
                     "autoround": None if args.peers_only else autoround(groups, args.iters, args.batch_size)}
        figures = []
        for modifier in modifiers.values():
            if modifier is None:
                figures.append((float("nan"), float("nan")))
                continue
            start = time.perf_counter()
            model = llmpress.oneshot(load(args.model), [modifier], batches)
            seconds = time.perf_counter() - start
            figures.append((perplexity(model, windows, progress=False).perplexity, seconds))
            del model
        (gptq, t_gptq), (tuned, t_tuned) = figures
        line = (f"| {row.upper()} | {gptq:.3f} | **{tuned:.3f}** | {gptq - dense:+.3f} / {tuned - dense:+.3f} | "
                f"{t_gptq:.0f} / {t_tuned:.0f} s |")
        if args.peer:
            line += peer_cells(args, data, groups, dense)
        if args.package:
            line += peer_cells(args, data, groups, dense, "autoround_package_worker.py")
        print(line, flush=True)


if __name__ == "__main__":
    main()
