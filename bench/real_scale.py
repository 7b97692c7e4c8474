"""A bf16 checkpoint of SmolLM2-135M's shapes, each tool as a whole process: time, peak memory, output bytes.

    python bench/real_scale.py [--recipes fp8 w4a16 gptq] [--runs 1] [--work DIR]

A random Llama with SmolLM2-135M-Instruct's shapes (30 layers, hidden 576, MLP 1536, 9 / 3 heads,
vocab 49152, tied embeddings) saved in bf16, as real checkpoints are. Each recipe runs as the
``llmpress oneshot`` command and as llm-compressor's ``oneshot`` on the model loaded in its own
dtype (``dtype="auto"``, as its examples do), one process each, back to back: seconds from start
to exit, peak RSS (``wait4``), and the bytes of the written safetensors. ``fp8``: FP8_DYNAMIC;
``w4a16``: RTN W4A16 in groups of 64; ``gptq``: GPTQ W4A16 in groups of 64 on 32 x 256 tokens
of the fixture's calibration text. llmpress takes its model-free path by itself for the first
two (the recipe needs no data); ``--model-class`` makes it load the model instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import PEER_PYTHON, REPO, fixture, work_folder

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

PEER = """
import json, sys
import torch
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, recipe, output, tokens = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
kwargs = {}
if tokens != "-":
    from datasets import Dataset
    samples = [json.loads(line)["input_ids"] for line in open(tokens)]
    kwargs = dict(dataset=Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}),
                  num_calibration_samples=len(samples), max_seq_length=len(samples[0]))
oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), recipe=recipe, output_dir=output, **kwargs)
"""


def smol_shaped(folder: Path) -> Path:
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(fixture("tiny-llama"))).save_pretrained(str(folder))
    return folder


def calibration_tokens(path: Path) -> Path:
    if not path.exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(fixture("tiny-llama")))
        ids = tokenizer(fixture("text", "calibration.txt").read_text(encoding="utf-8"))["input_ids"]
        path.write_text("".join(json.dumps({"input_ids": ids[i * SEQ_LEN:(i + 1) * SEQ_LEN]}) + "\n" for i in range(SAMPLES)))
    return path


def measure(command: list[str], env: dict) -> dict:
    """One process: wall seconds and peak RSS (MB) from wait4."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    error = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[:4]} failed:\n{error[-3000:]}")
    return {"seconds": seconds, "rss_mb": usage.ru_maxrss / 1024}


def output_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["fp8", "w4a16", "gptq"], choices=sorted(RECIPES))
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--model-class", action="store_true", help="llmpress loads the model (--no-model-free)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-real-scale-")
    model, tokens = work / "smol-bf16", work / "tokens.jsonl"
    if args.make:
        smol_shaped(model)
        calibration_tokens(tokens)
        return
    if not (model / "config.json").exists() or not tokens.exists():
        # made in a child: wait4's peak RSS of a child counts the parent's at fork
        subprocess.run([sys.executable, __file__, "--make", "--work", str(work)], check=True)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    rows = []
    for name in args.recipes:
        recipe = work / f"{name}.yaml"
        recipe.write_text(RECIPES[name], encoding="utf-8")
        data = ["--dataset", str(tokens), "--num-samples", str(SAMPLES), "--seq-len", str(SEQ_LEN)] if name == "gptq" else []
        for _ in range(args.runs):
            ours_out, peer_out = work / f"{name}-llmpress", work / f"{name}-llmcompressor"
            for folder in (ours_out, peer_out):
                shutil.rmtree(folder, ignore_errors=True)
            ours = measure([sys.executable, "-m", "llmpress", "oneshot", "--model", str(model), "--recipe", str(recipe),
                            "--output", str(ours_out), *data, *(["--no-model-free"] if args.model_class else [])],
                           {**env, "PYTHONPATH": str(REPO / "src")})
            peer = measure([str(PEER_PYTHON), "-c", PEER, str(model), str(recipe), str(peer_out), str(tokens) if data else "-"],
                           {**env, "PYTHONPATH": ""})
            ours["bytes"], peer["bytes"] = output_bytes(ours_out), output_bytes(peer_out)
            rows.append({"recipe": name, "ours": ours, "peer": peer})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nbf16 Llama of SmolLM2-135M's shapes ({output_bytes(model) / 1e6:.0f} MB), llmpress / llm-compressor, one process each")
    print(f"{'recipe':<7} {'seconds':>20} {'peak RSS MB':>22} {'output MB':>22}")
    for row in rows:
        o, p = row["ours"], row["peer"]
        print(f"{row['recipe']:<7} {o['seconds']:>6.1f}/{p['seconds']:<6.1f} {o['seconds'] / p['seconds']:>5.2f}x "
              f"{o['rss_mb']:>6.0f}/{p['rss_mb']:<6.0f} {o['rss_mb'] / p['rss_mb']:>5.2f}x "
              f"{o['bytes'] / 1e6:>7.2f}/{p['bytes'] / 1e6:<7.2f} {o['bytes'] / p['bytes']:>5.3f}x")


if __name__ == "__main__":
    main()
