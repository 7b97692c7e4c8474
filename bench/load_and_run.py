"""Loading and running compressed models: llmpress vs transformers + compressed-tensors, one run.

    python bench/load_and_run.py [--models tiny random-2048] [--new-tokens 32] [--repeat 3] [--work DIR]

For each model (the shared tiny-llama, and a randomly initialised Llama with hidden size 2048 and
8 layers built from a config), it writes an fp32 checkpoint, an int4 (W4A16, group 128) and an
int8 (per-channel, weight-only) compressed-tensors checkpoint with llmpress, then measures, each
in its own process:

- load time and peak RSS of the int4 checkpoint: ``llmpress.load`` vs transformers'
  ``from_pretrained`` with compressed-tensors (which decompresses on the first forward, so the
  time to a first forward is shown too); ``--repeat`` runs of each, alternating, medians shown;
- logits of both on the same input (relative L2 difference), for llmpress's checkpoint and for
  one llm-compressor wrote (RTN W4A16 in ``.venv-peers``, when it exists): through llmpress's bf16
  kernels, and through the exact dense view (``llmpress.load(..., dequantize=True)``);
- greedy decode tokens/s at batch 1: fp32, bf16, llmpress int8 and int4, transformers +
  compressed-tensors on the int4 checkpoint;
- quantize-on-load (``LlmpressConfig(bits=4)``) of the fp32 checkpoint: peak RSS against the
  fp32 file size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from common import PEER_PYTHON, REPO, fixture, median_run, save_random_llama, work_folder


def make_random_llama(folder: Path) -> Path:
    """Hidden 2048, 8 layers, the rest as TinyLlama-1.1B (GQA 32/4 heads, vocab 32000), fp32."""
    return save_random_llama(folder, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def compress(model_dir: Path, output: Path, weights: dict) -> Path:
    import llmpress
    from llmpress.modifiers import QuantizationModifier

    if not (output / "config.json").exists():
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        llmpress.oneshot(model_dir, QuantizationModifier(ignore=["lm_head"], config_groups=groups), output_dir=output)
    return output


def worker(*args: str, python: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": "" if python else str(REPO / "src"), "TQDM_DISABLE": "1"}
    command = [str(python or sys.executable), str(REPO / "bench" / "load_worker.py"), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"worker {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def file_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def logits_gap(checkpoint: Path, work: Path) -> dict:
    """Relative L2 distance of llmpress's logits (bf16 kernels; exact dense view) from
    transformers + compressed-tensors' on the same checkpoint and input."""
    worker("logits", "--tool", "transformers", "--model", str(checkpoint), "--out", str(work / "peer.pt"))
    peer = torch.load(work / "peer.pt")
    gaps = {}
    for tool in ("llmpress", "llmpress-exact"):
        worker("logits", "--tool", tool, "--model", str(checkpoint), "--out", str(work / "ours.pt"))
        gaps[tool] = float((torch.load(work / "ours.pt") - peer).norm() / peer.norm())
    return gaps


def bench_model(name: str, fp32: Path, work: Path, new_tokens: int, repeat: int) -> dict:
    int4 = compress(fp32, work / f"{name}-int4", {"num_bits": 4, "group_size": 128})
    int8 = compress(fp32, work / f"{name}-int8", {"num_bits": 8, "strategy": "channel"})
    row: dict = {"model": name, "fp32_mb": file_mb(fp32), "int4_mb": file_mb(int4)}
    ours_runs, peer_runs = [], []
    for _ in range(repeat):  # alternating, so both see the same state of the machine
        ours_runs.append(worker("load", "--tool", "llmpress", "--model", str(int4)))
        peer_runs.append(worker("load", "--tool", "transformers", "--model", str(int4)))
    row["load_ours"], row["load_peer"] = median_run(ours_runs), median_run(peer_runs)
    row["logits"] = {"llmpress": logits_gap(int4, work)}
    if PEER_PYTHON.exists():
        llmc = work / f"{name}-int4-llmcompressor"
        if not (llmc / "config.json").exists():
            worker("llmc-compress", "--model", str(fp32), "--out", str(llmc), python=PEER_PYTHON)
        row["logits"]["llm-compressor"] = logits_gap(llmc, work)
    decode = {}
    for label, tool, model in [("fp32", "fp32", fp32), ("bf16", "bf16", fp32), ("llmpress int8", "llmpress", int8),
                               ("llmpress int4", "llmpress", int4), ("transformers+ct int4", "transformers", int4)]:
        decode[label] = worker("decode", "--tool", tool, "--model", str(model), "--new-tokens", str(new_tokens))["tokens_per_s"]
    row["decode"] = decode
    row["onload"] = worker("onload", "--tool", "llmpress-onload", "--model", str(fp32), "--bits", "4")
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "random-2048"], choices=["tiny", "random-2048"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="load measurements per tool (medians shown)")
    parser.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "src"))
    work = work_folder(args.work, "llmpress-bench-")
    sources = {"tiny": fixture("tiny-llama"), "random-2048": work / "random-2048"}
    rows = []
    for name in args.models:
        fp32 = sources[name] if name == "tiny" else make_random_llama(sources[name])
        rows.append(bench_model(name, fp32, work, args.new_tokens, args.repeat))

    print("\nLoading the int4 checkpoint (W4A16 g128): llmpress vs transformers + compressed-tensors")
    print(f"{'model':<12} {'load s':>13} {'ratio':>6} {'to 1st fwd s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6}")
    for r in rows:
        o, p = r["load_ours"], r["load_peer"]
        print(f"{r['model']:<12} {o['load_s']:>6.2f}/{p['load_s']:<6.2f} {o['load_s'] / p['load_s']:>6.2f}"
              f" {o['ready_s']:>6.2f}/{p['ready_s']:<6.2f} {o['ready_s'] / p['ready_s']:>6.2f}"
              f" {o['peak_rss_mb']:>7.0f}/{p['peak_rss_mb']:<7.0f} {o['peak_rss_mb'] / p['peak_rss_mb']:>6.2f}")
    print("\nLogits vs transformers + compressed-tensors on the same int4 checkpoint (relative L2; 2 x 64 random tokens)")
    print(f"{'model':<12} {'written by':<15} {'llmpress.load (CPU kernels)':>29} {'dequantize=True (exact)':>24}")
    for r in rows:
        for writer, gaps in r["logits"].items():
            print(f"{r['model']:<12} {writer:<15} {gaps['llmpress']:>29.2e} {gaps['llmpress-exact']:>24.2e}")
    print(f"\nGreedy decode, batch 1, {args.new_tokens} new tokens after a 16-token prompt (tokens/s; ratio to fp32)")
    labels = list(rows[0]["decode"])
    print(f"{'model':<12} " + " ".join(f"{label:>22}" for label in labels) + f" {'int4 / t+ct':>12}")
    for r in rows:
        d = r["decode"]
        cells = " ".join(f"{d[label]:>12.1f} ({d[label] / d['fp32']:>4.2f}x)  " for label in labels)
        print(f"{r['model']:<12} {cells} {d['llmpress int4'] / d['transformers+ct int4']:>11.2f}x")
    print("\nQuantize-on-load int4 (LlmpressConfig(bits=4)) of the fp32 checkpoint")
    print(f"{'model':<12} {'fp32 file MB':>12} {'peak RSS MB':>12} {'ratio':>6} {'load s':>7}")
    for r in rows:
        o = r["onload"]
        print(f"{r['model']:<12} {r['fp32_mb']:>12.0f} {o['load_rss_mb']:>12.0f} {o['load_rss_mb'] / r['fp32_mb']:>6.2f} {o['load_s']:>7.2f}")
    print(f"\nload: medians of {args.repeat} alternating runs; peak RSS: the whole process (imports included),"
          "\nat the end of loading; times exclude imports;"
          "\nratios are llmpress / transformers + compressed-tensors unless said otherwise.")


if __name__ == "__main__":
    main()
