"""A bf16 checkpoint larger than the machine's memory, through the model-free path, at disk speed.

    python bench/larger_than_ram.py [--hidden 5120] [--layers 48] [--recipes fp8 nvfp4] [--model-class] [--work DIR]

Writes (once, into the work folder) a bf16 Llama of ``--hidden`` x ``--layers`` (MLP 2.7x hidden,
heads of 128, 8 key/value heads, vocab 32000) in shards of about 5 GB, without building the model:
each weight is one of a few random tensors scaled per layer, so that writing it is a matter of
disk, not of random numbers. Then, one after the other:

- the disk's sequential read rate: ``cat`` of the shards to /dev/null (the files are larger than
  the page cache, so the read comes from the disk);
- per recipe (``fp8``: FP8_DYNAMIC, ``nvfp4``: NVFP4A16, both ignoring lm_head), the
  ``llmpress oneshot`` command (it takes the model-free path by itself) and llm-compressor's
  ``model_free_ptq`` with 2 workers, each a whole process: seconds from the first import to the
  saved checkpoint, peak RSS, and the source's bytes per second against ``cat``'s; each output is
  deleted once measured (the disk holds the source and one output);
- ``--model-class``: the same FP8_DYNAMIC through the model class (``--no-model-free``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import work_folder
from gptq import PEER_PYTHON, run_worker

SCHEMES = {"fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4A16"}
SHARD_BYTES = 5 << 30


def llama_config(hidden: int, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": (hidden * 27 // 10 + 255) // 256 * 256, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 128, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    hidden, mlp, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (hidden, hidden)),
                   (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "mlp.gate_proj.weight", (mlp, hidden)), (p + "mlp.up_proj.weight", (mlp, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, mlp))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (config["vocab_size"], hidden))]


def write_checkpoint(folder: Path, hidden: int, layers: int) -> Path:
    """The sharded bf16 checkpoint, written once (its config.json is written last), each shard
    gathered in memory and written as transformers lays them out (``ShardedWriter``)."""
    import torch

    from llmpress.tensorfiles.write import ShardedWriter

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(hidden, layers)
    generator = torch.Generator().manual_seed(0)
    bases: dict[tuple[int, ...], torch.Tensor] = {}
    writer = ShardedWriter(folder, SHARD_BYTES, hold=SHARD_BYTES)
    for name, shape in tensor_shapes(config):
        if shape not in bases:
            bases[shape] = ((torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) if len(shape) == 2
                            else torch.ones(shape, dtype=torch.bfloat16))
        layer = int(name.split(".")[2]) if ".layers." in name else 0
        writer.add(name, bases[shape] * (1 + 0.01 * layer))
    writer.finish()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def read_rate(folder: Path) -> tuple[float, float]:
    """Seconds and bytes per second of ``cat`` of the shards to /dev/null."""
    files = sorted(folder.glob("*.safetensors"))
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    seconds = time.perf_counter() - start
    return seconds, sum(f.stat().st_size for f in files) / seconds


def recipe_file(work: Path, name: str) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(f"quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {{targets: [Linear], ignore: [lm_head], scheme: {SCHEMES[name]}}}\n")
    return path


def measure(tool: str, recipe: Path, model: Path, output: Path, source_bytes: int, disk_rate: float) -> dict:
    python = PEER_PYTHON if tool.startswith("llmcompressor") else Path(sys.executable)
    try:
        row = run_worker(python, tool, recipe, model, Path("-"), output)
    except SystemExit as exc:  # a refusal or a failure: its last lines
        row = {"failed": str(exc).strip().splitlines()[-1][:300]}
    else:
        row["rate_mb_s"] = source_bytes / row["compress_s"] / 1e6
        row["of_disk"] = source_bytes / row["compress_s"] / disk_rate
        row["output_gb"] = sum(f.stat().st_size for f in output.glob("*.safetensors")) / 1e9
    shutil.rmtree(output, ignore_errors=True)
    print(json.dumps({"tool": tool, "recipe": recipe.stem, **row}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--recipes", nargs="+", default=["fp8", "nvfp4"], choices=sorted(SCHEMES))
    parser.add_argument("--model-class", action="store_true", help="also FP8_DYNAMIC through the model class")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-larger-than-ram-")
    started = time.perf_counter()
    model = write_checkpoint(work / f"llama-{args.hidden}x{args.layers}-bf16", args.hidden, args.layers)
    source_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    print(f"checkpoint {model}: {source_bytes / 1e9:.1f} GB in {len(list(model.glob('*.safetensors')))} shards "
          f"(memory {memory / 1e9:.1f} GB; made in {time.perf_counter() - started:.0f} s)", flush=True)
    seconds, disk_rate = read_rate(model)
    print(f"cat of the shards: {seconds:.1f} s, {disk_rate / 1e6:.0f} MB/s", flush=True)
    rows = []
    for name in args.recipes:
        recipe = recipe_file(work, name)
        tools = ["llmpress"] + ([] if args.no_peer else ["llmcompressor-model-free"])
        rows += [(name, tool, measure(tool, recipe, model, work / f"out-{name}-{tool}", source_bytes, disk_rate)) for tool in tools]
    if args.model_class:
        rows.append(("fp8", "llmpress-model-class", measure("llmpress-model-class", recipe_file(work, "fp8"), model,
                                                            work / "out-fp8-model-class", source_bytes, disk_rate)))
    print(f"\n{source_bytes / 1e9:.1f} GB bf16 Llama ({args.hidden} x {args.layers}), memory {memory / 1e9:.1f} GB, "
          f"cat {disk_rate / 1e6:.0f} MB/s")
    print(f"{'recipe':<7} {'tool':<26} {'seconds':>8} {'peak RSS MB':>12} {'MB/s':>7} {'of cat':>7} {'output GB':>10}")
    for name, tool, row in rows:
        if "failed" in row:
            print(f"{name:<7} {tool:<26} failed: {row['failed']}")
            continue
        print(f"{name:<7} {tool:<26} {row['compress_s']:>8.1f} {row['rss_mb']:>12.0f} {row['rate_mb_s']:>7.0f} "
              f"{row['of_disk']:>7.2f} {row['output_gb']:>10.2f}")


if __name__ == "__main__":
    main()
