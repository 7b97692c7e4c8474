"""Loading and running compressed models: llmpress vs transformers + compressed-tensors, one run.

    python bench/load_and_run.py [--models tiny random-2048] [--new-tokens 32] [--work DIR]

For each model (the shared tiny-llama, and a randomly initialised Llama with hidden size 2048 and
8 layers built from a config), it writes an fp32 checkpoint, an int4 (W4A16, group 128) and an
int8 (per-channel, weight-only) compressed-tensors checkpoint with llmpress, then measures, each
in its own process:

- load time and peak RSS of the int4 checkpoint: ``llmpress.load`` vs transformers'
  ``from_pretrained`` with compressed-tensors (which decompresses on the first forward, so the
  time to a first forward is shown too);
- logits of both on the same input (relative L2 difference);
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
import tempfile
from pathlib import Path

import torch
from common import REPO, fixture, save_random_llama


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


def worker(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TQDM_DISABLE": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "load_worker.py"), *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"worker {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def file_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def bench_model(name: str, fp32: Path, work: Path, new_tokens: int) -> dict:
    int4 = compress(fp32, work / f"{name}-int4", {"num_bits": 4, "group_size": 128})
    int8 = compress(fp32, work / f"{name}-int8", {"num_bits": 8, "strategy": "channel"})
    row: dict = {"model": name, "fp32_mb": file_mb(fp32), "int4_mb": file_mb(int4)}
    row["load_ours"] = worker("load", "--tool", "llmpress", "--model", str(int4))
    row["load_peer"] = worker("load", "--tool", "transformers", "--model", str(int4))
    worker("logits", "--tool", "llmpress", "--model", str(int4), "--out", str(work / "ours.pt"))
    worker("logits", "--tool", "transformers", "--model", str(int4), "--out", str(work / "peer.pt"))
    ours, peer = torch.load(work / "ours.pt"), torch.load(work / "peer.pt")
    row["logits_rel_l2"] = float((ours - peer).norm() / peer.norm())
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
    parser.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "src"))
    work = Path(args.work or tempfile.mkdtemp(prefix="llmpress-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    sources = {"tiny": fixture("tiny-llama"), "random-2048": work / "random-2048"}
    rows = []
    for name in args.models:
        fp32 = sources[name] if name == "tiny" else make_random_llama(sources[name])
        rows.append(bench_model(name, fp32, work, args.new_tokens))

    print("\nLoading the int4 checkpoint (W4A16 g128): llmpress vs transformers + compressed-tensors")
    print(f"{'model':<12} {'load s':>13} {'ratio':>6} {'to 1st fwd s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6} {'logits rel L2':>13}")
    for r in rows:
        o, p = r["load_ours"], r["load_peer"]
        print(f"{r['model']:<12} {o['load_s']:>6.2f}/{p['load_s']:<6.2f} {o['load_s'] / p['load_s']:>6.2f}"
              f" {o['ready_s']:>6.2f}/{p['ready_s']:<6.2f} {o['ready_s'] / p['ready_s']:>6.2f}"
              f" {o['peak_rss_mb']:>7.0f}/{p['peak_rss_mb']:<7.0f} {o['peak_rss_mb'] / p['peak_rss_mb']:>6.2f} {r['logits_rel_l2']:>13.2e}")
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
    print("\npeak RSS: the whole process (imports included), at the end of loading; times exclude imports;"
          "\nratios are llmpress / transformers + compressed-tensors unless said otherwise.")


if __name__ == "__main__":
    main()
