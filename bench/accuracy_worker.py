"""One run of ``bench/accuracy.py``, in a process of its own so that its peak memory is its own:
one recipe applied by one tool to a fresh float32 copy of the model, calibrated on the given
token ids, then the perplexity of the given windows measured on the model as the tool leaves it
in memory (its fake quantization of weights and activations, its run-time rotations, on).

    python bench/accuracy_worker.py {llmpress,llm-compressor} MODEL_DIR DATA.pt RECIPE.yaml

The same recipe file goes to both tools (llmpress reads llm-compressor's recipe grammar).
``DATA.pt`` holds ``{"batches": [[ids]...], "windows": LongTensor}``. Runs in llmpress's virtual
environment or llm-compressor's (stdlib, torch and transformers at the top). Prints one JSON line
``{"perplexity", "seconds", "peak_mb"}`` (the peak resident set up to the end of compression), or ``{"refused": message}`` when the tool refuses the
recipe (a result too: a peer that cannot run a recipe has no figure for it).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from common import let_peer_awq_run_without_gpu, peak_rss_mb, peer_calibration
from perplexity_worker import perplexity
from transformers import AutoModelForCausalLM


def run_llmpress(model, data: dict, recipe: str) -> None:
    import llmpress

    llmpress.oneshot(model, recipe, data["batches"])


def run_llm_compressor(model, data: dict, recipe: str) -> None:
    from llmcompressor import oneshot

    if "AWQModifier" in recipe:
        let_peer_awq_run_without_gpu()
    oneshot(model=model, recipe=recipe, **peer_calibration(data["batches"]))


def main() -> None:
    tool, model_dir, data_file, recipe_file = sys.argv[1:5]
    data = torch.load(data_file)
    recipe = open(recipe_file).read()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    try:
        (run_llmpress if tool == "llmpress" else run_llm_compressor)(model, data, recipe)
    except Exception as exc:  # noqa: BLE001 -- a refusal is a result
        print(json.dumps({"refused": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}))
        return
    seconds = time.perf_counter() - start
    peak = peak_rss_mb()  # loading and compressing; the evaluation's logits would outweigh both
    model.to(torch.float32)  # auto-round leaves its blocks in bf16 where the CPU has bf16 units
    print(json.dumps({"perplexity": perplexity(model, data["windows"]), "seconds": seconds, "peak_mb": peak}))


if __name__ == "__main__":
    main()
