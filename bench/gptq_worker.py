"""One compression run in its own process, for bench/gptq.py, moe.py and awq.py: llmpress or llm-compressor.

    python bench/gptq_worker.py TOOL RECIPE_YAML MODEL_DIR TOKENS_JSONL OUTPUT_DIR

TOOL is ``llmpress`` (the ``llmpress oneshot`` command, as a user runs it: this process runs the
console script's own function), ``llmpress-model-class`` (the same with ``--no-model-free``),
``llmpress-api`` (``llmpress.oneshot`` from Python), ``llmpress-float32-compute`` (the command with
``--compute-dtype float32``: a bf16 model's layers calibrate in float32), ``llmcompressor`` (its ``oneshot`` from
Python on the model in its own dtype: it has no command for this) or ``llmcompressor-model-free``
(its ``model_free_ptq`` with the recipe's one QuantizationModifier's scheme and ignore list, and
``BENCH_WORKERS`` threads, 2 by default). Both tools read the same
recipe file, llm-compressor's YAML format, and the same token ids (one JSON line a sample);
TOKENS_JSONL ``-`` is no calibration data (a data-free recipe).

Prints one JSON line: {"seconds": from the tool's first import to the saved checkpoint,
"peak_rss_mb": the process's peak resident memory, "peak_gpu_mb": its peak of CUDA tensors, 0 without}.
"""

from __future__ import annotations

import atexit
import json
import sys
import time

from common import let_peer_awq_run_without_gpu, peak_gpu_mb, peak_rss_mb, peer_calibration

START = time.perf_counter()


def report() -> None:
    print(json.dumps({"seconds": time.perf_counter() - START, "peak_rss_mb": peak_rss_mb(), "peak_gpu_mb": peak_gpu_mb()}),
          flush=True)


def read_tokens(path: str) -> list[list[int]]:
    with open(path, encoding="utf-8") as lines:
        return [json.loads(line)["input_ids"] for line in lines if line.strip()]


def run_llmpress_command(recipe: str, model_dir: str, tokens: str, output: str, *options: str) -> None:
    data = []
    if tokens != "-":
        samples = read_tokens(tokens)
        data = ["--dataset", tokens, "--num-samples", str(len(samples)), "--seq-len", str(len(samples[0]))]
    sys.argv = ["llmpress", "oneshot", "--model", model_dir, "--recipe", recipe, *data, "--output", output, *options]
    from llmpress.cli import run

    atexit.register(report)  # run() exits, as the command does
    run()


def run_llmpress_api(recipe: str, model_dir: str, tokens: str, output: str) -> None:
    import llmpress
    from llmpress.data import CalibrationOptions

    samples = read_tokens(tokens)
    options = CalibrationOptions(num_samples=len(samples), seq_len=len(samples[0]), shuffle=False)
    llmpress.oneshot(model_dir, recipe, samples, output_dir=output, calibration=options)
    report()


def run_llmcompressor(recipe: str, model_dir: str, tokens: str, output: str) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "AWQModifier" in open(recipe, encoding="utf-8").read():
        let_peer_awq_run_without_gpu()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # the checkpoint's own dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = {}
    if tokens != "-":
        samples = read_tokens(tokens)
        data = peer_calibration(samples)
    oneshot(model=model, processor=tokenizer, recipe=recipe, output_dir=output, **data)
    report()


def run_llmcompressor_model_free(recipe: str, model_dir: str, tokens: str, output: str) -> None:
    import os

    import yaml
    from llmcompressor import model_free_ptq

    stage = next(iter(yaml.safe_load(open(recipe, encoding="utf-8")).values()))
    modifier = next(iter(stage.values()))["QuantizationModifier"]
    # model_free_ptq quantizes every 2-D weight but the ignored ones, the embeddings too, where the
    # recipe's Linear target does not reach them: ignored, so that both tools write the same tensors
    model_free_ptq(model_dir, output, scheme=modifier["scheme"], ignore=[*modifier.get("ignore", []), "re:.*embed_tokens$"],
                   max_workers=int(os.environ.get("BENCH_WORKERS", "2")))
    report()


def main() -> None:
    tool, recipe, model_dir, tokens, output = sys.argv[1:6]
    runs = {"llmpress": run_llmpress_command, "llmpress-api": run_llmpress_api, "llmcompressor": run_llmcompressor,
            "llmcompressor-model-free": run_llmcompressor_model_free,
            "llmpress-model-class": lambda *args: run_llmpress_command(*args, "--no-model-free"),
            "llmpress-float32-compute": lambda *args: run_llmpress_command(*args, "--compute-dtype", "float32")}
    runs[tool](recipe, model_dir, tokens, output)


if __name__ == "__main__":
    main()
