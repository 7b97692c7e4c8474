"""The main job on the bundled default: compress, save, reload, evaluate, print a table.

Compresses the bundled tiny Llama with W4A16 and W8A8 (RTN), saves each as a compressed-tensors
checkpoint, reloads it through transformers (with compressed-tensors) and through llmpress, and
prints perplexity on the bundled evaluation text, the KL divergence of each one's next-token
distributions from fp32's, size on disk and time, beside fp32.

    python examples/demo.py [--output out/demo] [--schemes W4A16 W8A8] [--max-windows 200]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

import torch

import llmpress
from llmpress.data import CalibrationOptions
from llmpress.evaluation import evaluation_windows, kl_divergence, perplexity
from llmpress.evaluation.report import plot_results
from llmpress.loading.loader import read_model_and_processor

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "assets" / "tiny-llama"
CALIBRATION = ROOT / "assets" / "text" / "calibration.txt"
EVALUATION = ROOT / "assets" / "text" / "evaluation.txt"


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def transformers_perplexity(folder: Path, windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return perplexity(model.eval(), windows, progress=False).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(ROOT / "out" / "demo"))
    parser.add_argument("--schemes", nargs="+", default=["W4A16", "W8A8"])
    parser.add_argument("--max-windows", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)

    model, tokenizer = read_model_and_processor(MODEL)
    windows = evaluation_windows(EVALUATION.read_text(encoding="utf-8"), tokenizer, 256, args.max_windows)
    rows = []

    start = time.perf_counter()
    llmpress.save_checkpoint(out / "fp32", model, tokenizer)  # the reference, dense, as fp32
    save_s = time.perf_counter() - start
    ours = perplexity(model, windows, progress=False)
    rows.append(("fp32", ours.perplexity, transformers_perplexity(out / "fp32", windows), 0.0, folder_mb(out / "fp32"), save_s, ours.seconds))

    for scheme in args.schemes:
        print(f"compressing with {scheme} ...", flush=True)
        start = time.perf_counter()
        shutil.rmtree(out / scheme, ignore_errors=True)  # the demo's own checkpoint of an earlier run (llmpress never replaces unasked)
        llmpress.oneshot(MODEL, scheme, CALIBRATION, output_dir=out / scheme, calibration=CalibrationOptions(num_samples=64, seq_len=256))
        compress_s = time.perf_counter() - start
        reloaded = llmpress.load_checkpoint(out / scheme)
        ours = perplexity(reloaded, windows, progress=False)  # timed alone: "eval s" is the reloaded model's own speed
        kl = kl_divergence(model, reloaded, windows, progress=False)
        rows.append((scheme, ours.perplexity, transformers_perplexity(out / scheme, windows), kl, folder_mb(out / scheme), compress_s, ours.seconds))

    base = rows[0][1]
    print()
    print(f"tiny-llama, perplexity on {windows.shape[0]} windows x {windows.shape[1]} tokens of the bundled evaluation text")
    header = (f"{'scheme':<8} {'ppl llmpress':>12} {'ppl transformers':>16} {'vs fp32':>8} {'KL vs fp32':>10} {'size MB':>8} "
              f"{'compress s':>10} {'eval s':>7}")
    print(header)
    print("-" * len(header))
    for name, ppl, ppl_hf, kl, size, compress_s, eval_s in rows:
        print(f"{name:<8} {ppl:>12.3f} {ppl_hf:>16.3f} {ppl / base - 1:>+8.2%} {kl:>10.2e} {size:>8.2f} {compress_s:>10.2f} {eval_s:>7.2f}")
    print("(KL vs fp32: mean nats per predicted token; it ranks two compressions where perplexity's change is within its noise)")
    plot = plot_results(
        [{"model": name, "perplexity": ppl, "kl_vs_first": kl, "windows": windows.shape[0], "seq_len": windows.shape[1]}
         for name, ppl, _, kl, *_ in rows],
        out / "perplexity.png",
    )
    print(f"\ncheckpoints and {plot.name} in {out}")


if __name__ == "__main__":
    main()
