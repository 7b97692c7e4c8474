"""The architecture matrix, llmpress vs llm-compressor 0.14: which families each compresses, and how much of them.

    python bench/architectures.py [--only llama,gpt2] [--work DIR]

Every tiny random model of ``tests/architectures.py`` (2 layers, hidden 128, saved by
``save_pretrained``) goes through both tools with the same recipe (W4A16, ``Linear`` targets,
lm_head, routers and vision towers ignored) as RTN (``QuantizationModifier``) and GPTQ (4 samples
of 32 tokens of the shared calibration text): llmpress through ``llmpress oneshot`` in this
process, llm-compressor through its ``oneshot`` in one process of the peers' environment
(transformers 5.17). Each cell is the share of the recipe's targeted weights (by element count:
every matrix but embeddings, head, routers and vision side) that the saved checkpoint stores
packed, or the first line of the error that stopped the tool.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

from common import PEER_PYTHON, REPO, fixture, peer_calibration, work_folder

sys.path.insert(0, str(REPO / "tests"))
from architectures import ARCHITECTURES, DENSE_ALLOWED, RECIPE, save_tiny  # noqa: E402

MODIFIERS = ("QuantizationModifier", "GPTQModifier")
SAMPLES, SEQ_LEN = 4, 32


def packed_share(folder: Path) -> float:
    """Share of the targeted weights' elements stored packed in the checkpoint at ``folder``."""
    from safetensors import safe_open

    packed = dense = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                if DENSE_ALLOWED.search(key):
                    continue
                if key.endswith("weight_shape"):
                    shape = handle.get_tensor(key).tolist()
                    packed += shape[0] * shape[1]
                elif not key.endswith(("weight_packed", "weight_scale", "weight_zero_point", "bias")):
                    sliced = handle.get_slice(key)
                    shape = sliced.get_shape()
                    if len(shape) >= 2:
                        size = 1
                        for n in shape:
                            size *= n
                        dense += size
    return packed / max(packed + dense, 1)


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:90]


def run_llmpress(source: Path, recipe: Path, output: Path, modifier: str) -> None:
    from llmpress.cli import main as cli

    args = ["oneshot", "--model", str(source), "--recipe", str(recipe), "--output", str(output)]
    if modifier == "GPTQModifier":
        args += ["--dataset", str(fixture("text", "calibration.txt")), "--num-samples", str(SAMPLES), "--seq-len", str(SEQ_LEN)]
    if cli(args) != 0:
        raise RuntimeError("llmpress oneshot exited with an error")


def run_llmcompressor(source: Path, recipe: Path, output: Path, modifier: str) -> None:
    import torch
    from architectures import auto_class
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    model_type = json.loads((source / "config.json").read_text())["model_type"]
    model = auto_class(model_type).from_pretrained(str(source), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    kwargs = {}
    if modifier == "GPTQModifier":
        text = fixture("text", "calibration.txt").read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples = [ids[i * SEQ_LEN : (i + 1) * SEQ_LEN] for i in range(SAMPLES)]
        kwargs = peer_calibration(samples)
    oneshot(model=model, processor=tokenizer, recipe=str(recipe), output_dir=str(output), **kwargs)


def matrix(tool: str, names: list[str], work: Path) -> dict[str, dict[str, str]]:
    """``{architecture: {modifier: cell}}`` for one tool, in this process."""
    run = run_llmpress if tool == "llmpress" else run_llmcompressor
    results: dict[str, dict[str, str]] = {}
    for name in names:
        source = work / "models" / name
        if not (source / "config.json").exists():
            save_tiny(name, source, fixture("tiny-llama"))
        results[name] = {}
        for modifier in MODIFIERS:
            recipe = work / f"{modifier}.yaml"
            recipe.write_text(RECIPE.format(modifier=modifier))
            output = work / tool / name / modifier
            shutil.rmtree(output, ignore_errors=True)  # a fresh compression for each tool and run
            try:
                run(source, recipe, output, modifier)
                share = f"{100 * packed_share(output):.0f}%"
                config = json.loads((output / "config.json").read_text()).get("quantization_config") or {}
                results[name][modifier] = share + (" (saved with format dense)" if config.get("format") == "dense" else "")
            except Exception as error:  # a tool's failure is a result here
                traceback.print_exc()
                results[name][modifier] = f"fails: {first_line(error)}"
            print(f"{tool} {name} {modifier}: {results[name][modifier]}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: the whole matrix)")
    parser.add_argument("--work", help="folder for models and checkpoints (default: a new temporary one)")
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)  # the llm-compressor side: JSON results to this file
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ARCHITECTURES)
    work = work_folder(args.work, "llmpress-architectures-")
    if args.peer_worker:
        Path(args.peer_worker).write_text(json.dumps(matrix("llmcompressor", names, work)))
        return

    from gptq import prepare_peer_runs

    prepare_peer_runs()
    peer_file = work / "llmcompressor.json"
    env_args = [str(PEER_PYTHON), __file__, "--work", str(work), "--peer-worker", str(peer_file)]
    if args.only:
        env_args += ["--only", args.only]
    for name in names:  # built once here (transformers 5.24), read by both
        if not (work / "models" / name / "config.json").exists():
            save_tiny(name, work / "models" / name, fixture("tiny-llama"))
    ours = matrix("llmpress", names, work)
    subprocess.run(env_args, check=True, env={"PYTHONPATH": "", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
                                              "PATH": "/usr/bin:/bin"})
    theirs = json.loads(peer_file.read_text())

    print("\n| architecture | llmpress RTN | llmpress GPTQ | llm-compressor RTN | llm-compressor GPTQ |")
    print("|---|---|---|---|---|")
    for name in names:
        cells = [ours[name][m] for m in MODIFIERS] + [theirs[name][m] for m in MODIFIERS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nshare of the recipe's targeted weights stored packed; 'fails' = the tool stopped")


if __name__ == "__main__":
    main()
