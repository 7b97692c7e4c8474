"""GPTQ benchmark: llmpress vs llm-compressor 0.14, same models, same recipe, same calibration tokens, one run.

    python bench/gptq.py [--models tiny random-1024] [--bits 4 3] [--repeat 3] [--repeat-large 1] [--work DIR] [--api]

Each compression runs in its own process (peak RSS from the OS, wall time of the whole process
including imports and model loading; both packages' bytecode compiled beforehand, as installed),
each tool as its users run it: llmpress as the ``llmpress oneshot`` command (``--api``:
``llmpress.oneshot`` from a Python script instead), llm-compressor's ``oneshot`` from a Python
script, both reading one recipe file in llm-compressor's YAML format and one JSON-lines file of
token ids. llm-compressor runs from its own virtual environment, ``.venv-peers`` (created with
``torch==2.13.0 llmcompressor==0.14.0`` when missing). The small trained model is also evaluated:
perplexity on the evaluation text of both tools' checkpoints, read back through transformers +
compressed-tensors, and llmpress's RTN at the same scheme.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import PEER_PYTHON, PEER_VENV, REPO, fixture, median_run, pair_cells, save_random_llama, work_folder


def ensure_peer_venv() -> None:
    if PEER_PYTHON.exists():
        return
    print("creating .venv-peers with llm-compressor 0.14 (once; a few minutes) ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(PEER_PYTHON), "-m", "pip", "install", "--quiet", "torch==2.13.0", "llmcompressor==0.14.0"], check=True)


def compile_sources() -> None:
    """llmpress's bytecode, written once as ``pip install`` writes it for an installed package
    (llm-compressor's was written when .venv-peers was made). Where PYTHONDONTWRITEBYTECODE is set,
    as on this project's machines, a checkout would otherwise compile its ~70 modules again in
    every timed process (about 0.15 s each time)."""
    import compileall

    compileall.compile_dir(str(REPO / "src" / "llmpress"), quiet=1)


def prepare_peer_runs() -> None:
    """Offline, llmpress importable from this checkout, the peers' environment made, both
    packages' bytecode compiled: what every run against llm-compressor needs first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "src"))
    ensure_peer_venv()
    compile_sources()


def bench_inputs(work: Path, names: list[str]) -> tuple[dict[str, Path], Path, torch.Tensor]:
    """What the GPTQ and AWQ benches run on: the models (the trained tiny one; the random
    hidden-1024 Llama when ``names`` has it), the calibration tokens and the evaluation windows."""
    from transformers import AutoTokenizer

    from llmpress.evaluation import evaluation_windows

    tiny = fixture("tiny-llama")
    models = {"tiny": tiny}
    if "random-1024" in names:
        models["random-1024"] = make_random_llama(work / "random-1024", tiny)
    if "llama3-8b-layers" in names:
        models["llama3-8b-layers"] = make_llama3_8b_layers(work / "llama3-8b-layers", tiny)
    tokens = calibration_tokens(work / "tokens.jsonl", tiny)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    windows = evaluation_windows(fixture("text", "evaluation.txt").read_text(encoding="utf-8"), tokenizer, 256, 200)
    return models, tokens, windows


def make_random_llama(folder: Path, tokenizer_dir: Path) -> Path:
    """A randomly initialised Llama, hidden 1024, 8 layers, saved as fp32 safetensors."""
    return save_random_llama(folder, tokenizer_dir, vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)


def make_llama3_8b_layers(folder: Path, tokenizer_dir: Path) -> Path:
    """A randomly initialised Llama with Llama-3-8B's layer shapes (hidden 4096, MLP 14336, 32
    query and 8 key/value heads), 4 layers, the tiny tokenizer's 4096-word vocabulary: GPTQ's work
    per layer is the 8B model's, the embeddings are small. fp32 safetensors, 3.6 GB."""
    return save_random_llama(folder, tokenizer_dir, vocab_size=4096, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=512)


def calibration_tokens(path: Path, tokenizer_dir: Path, samples: int = 64, seq_len: int = 256) -> Path:
    """The first ``samples * seq_len`` tokens of the shared calibration text, one sample a JSON line."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tokenizer(fixture("text", "calibration.txt").read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    path.write_text("".join(json.dumps({"input_ids": ids[i * seq_len : (i + 1) * seq_len]}) + "\n" for i in range(samples)))
    return path


def gptq_recipe(path: Path, bits: int) -> Path:
    """llm-compressor's GPTQ recipe: int weights in groups of 128, lm_head left alone."""
    path.write_text(f"""quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {{num_bits: {bits}, type: int, symmetric: true, strategy: group, group_size: 128}}
""")
    return path


def run_worker(python: Path, tool: str, recipe: Path, model: Path, tokens: Path, output: Path) -> dict:
    """One compression in a child process: wall time (imports and loading included), the time
    from the tool's first import to saved checkpoint, and the process's peak RSS in MB."""
    shutil.rmtree(output, ignore_errors=True)  # a fresh compression (llmpress refuses to replace what it is not asked to)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") if tool.startswith("llmpress") else "", "TQDM_DISABLE": "1"}
    result = subprocess.run([str(python), str(REPO / "bench" / "gptq_worker.py"), tool, str(recipe), str(model), str(tokens), str(output)],
                            capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    figures = {"wall_s": wall, "compress_s": report["seconds"], "rss_mb": report["peak_rss_mb"]}
    if report.get("peak_gpu_mb"):  # on a GPU machine
        figures["gpu_mb"] = report["peak_gpu_mb"]
    return figures


def run_pairs(ours_tool: str, recipe: Path, model: Path, tokens: Path | list[Path], output: Path, runs: int,
              peer_recipe: Path | None = None) -> dict:
    """``runs`` pairs of compressions, llmpress then llm-compressor back to back (into
    ``output``-llmpress and ``output``-llmcompressor; llm-compressor reads ``peer_recipe`` when
    given): per-figure medians of each tool and the median of the pairs' ratios (a pair sees the
    machine in one state). ``tokens`` may be a list of files, calibration orders
    (``calibration_orders``): pair i calibrates on file i (cycling) and its checkpoints are
    kept, order i's in ``output``-TOOL-order{i} from the second on (``pair_outputs``)."""
    ours_runs, peer_runs = [], []
    files = tokens if isinstance(tokens, list) else [tokens]
    for i in range(runs):
        order = i % len(files)
        ours, peer = pair_outputs(output, order)
        ours_runs.append(run_worker(Path(sys.executable), ours_tool, recipe, model, files[order], ours))
        peer_runs.append(run_worker(PEER_PYTHON, "llmcompressor", peer_recipe or recipe, model, files[order], peer))
    ratios = {key: statistics.median(o[key] / p[key] for o, p in zip(ours_runs, peer_runs)) for key in ours_runs[0]}
    return {"ours": median_run(ours_runs), "peer": median_run(peer_runs), "ratios": ratios,
            "runs": {"ours": ours_runs, "peer": peer_runs}}


def pair_outputs(output: Path, order: int) -> tuple[Path, Path]:
    """Where pair ``order``'s checkpoints go: llmpress's, llm-compressor's."""
    suffix = f"-order{order}" if order else ""
    return Path(f"{output}-llmpress{suffix}"), Path(f"{output}-llmcompressor{suffix}")


def calibration_orders(tokens: Path, count: int) -> list[Path]:
    """``tokens`` and ``count - 1`` shuffles of its samples (seeds 1, 2, ...), one file each.
    llm-compressor's GPTQ rounds differently when the samples come in another order (float sums),
    and through the per-token int8 inputs of the next layers that moves a W8A8 model's perplexity
    by a few thousandths, so one run of it says little at that level; it shuffles every run
    itself (an unseeded sampler), so its runs are as many random orders. llmpress calibrates on
    each file in its order and, summing one Hessian product per sample, writes the same
    checkpoint for every order: the files show that, and llm-compressor's spread."""
    import random

    lines = tokens.read_text(encoding="utf-8").splitlines(keepends=True)
    files = [tokens]
    for seed in range(1, count):
        shuffled = list(lines)
        random.Random(seed).shuffle(shuffled)
        path = tokens.with_name(f"{tokens.stem}-order{seed}.jsonl")
        path.write_text("".join(shuffled), encoding="utf-8")
        files.append(path)
    return files


def transformers_perplexity(checkpoint: Path, windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    from llmpress.evaluation import perplexity

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return perplexity(model, windows, progress=False).perplexity


def rtn_perplexity(model_dir: Path, bits: int, windows: torch.Tensor, symmetric: bool = True) -> float:
    """Round-to-nearest with the benches' scheme (int weights, groups of 128, lm_head dense)."""
    import llmpress
    from llmpress.evaluation import perplexity
    from llmpress.modifiers import QuantizationModifier

    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, "symmetric": symmetric, "group_size": 128}}}
    model = llmpress.oneshot(model_dir, QuantizationModifier(ignore=["lm_head"], config_groups=groups))
    return perplexity(model, windows, progress=False).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "random-1024"], choices=["tiny", "random-1024", "llama3-8b-layers"])
    parser.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    parser.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary folder)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool on the tiny model (the median is shown)")
    parser.add_argument("--repeat-large", type=int, default=1, help="runs per tool on the 1024-hidden model (the median is shown)")
    parser.add_argument("--api", action="store_true", help="run llmpress from Python (llmpress.oneshot), not as its command")
    args = parser.parse_args()
    prepare_peer_runs()
    work = work_folder(args.work, "llmpress-bench-")
    models, tokens, windows = bench_inputs(work, args.models)
    tiny = models["tiny"]
    ours_tool = "llmpress-api" if args.api else "llmpress"
    fp32 = transformers_perplexity(tiny, windows)

    rows = []
    for name in args.models:
        for bits in args.bits if name == "tiny" else args.bits[:1]:  # the large model: first width only
            runs = args.repeat if name == "tiny" else args.repeat_large  # alternating runs, medians
            recipe = gptq_recipe(work / f"gptq-w{bits}.yaml", bits)
            row = {"model": name, "bits": bits, **run_pairs(ours_tool, recipe, models[name], tokens, work / f"{name}-w{bits}", runs)}
            if name == "tiny":
                row["ppl_ours"] = transformers_perplexity(work / f"{name}-w{bits}-llmpress", windows)
                row["ppl_peer"] = transformers_perplexity(work / f"{name}-w{bits}-llmcompressor", windows)
                row["ppl_rtn"] = rtn_perplexity(tiny, bits, windows)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nGPTQ, 64 x 256 calibration tokens, group 128; fp32 perplexity of tiny-llama {fp32:.3f}")
    header = (f"{'model':<12} {'bits':>4} {'in-process s':>13} {'ratio':>6} {'peak RSS MB':>15} {'ratio':>6} {'wall s':>13} {'ratio':>6}"
              f" {'ppl llmpress':>12} {'ppl llm-c':>9} {'ppl RTN':>8} {'rise ratio':>10}")
    gpu = all("gpu_mb" in r["ours"] and "gpu_mb" in r["peer"] for r in rows)
    if gpu:
        header += f" {'peak GPU MB':>15} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['model']:<12} {r['bits']:>4} {pair_cells(r, ('compress_s', 'rss_mb', 'wall_s'))}"
        if "ppl_ours" in r:
            rise = (r["ppl_ours"] - fp32) / max(r["ppl_peer"] - fp32, 1e-9)
            line += f" {r['ppl_ours']:>12.3f} {r['ppl_peer']:>9.3f} {r['ppl_rtn']:>8.3f} {rise:>10.2f}"
        elif gpu:
            line += " " * 44
        if gpu:
            line += f" {pair_cells(r, ('gpu_mb',))}"
        print(line)
    how = "llmpress.oneshot from Python" if args.api else "the llmpress oneshot command"
    print(f"\nllmpress ran as {how}, llm-compressor as its oneshot from Python, both on the same recipe file and tokens."
          f"\nin-process (the headline): from the tool's first import to the saved checkpoint; wall: the whole process"
          f" (interpreter start-up and exit too); medians of {args.repeat} runs on tiny, {args.repeat_large} on random-1024;"
          "\nratios: llmpress / llm-compressor, the median over the alternating pairs of runs (a pair runs back to back);"
          "\nrise ratio: (ppl llmpress - fp32) / (ppl llm-compressor - fp32); perplexities read back through transformers.")


if __name__ == "__main__":
    main()
