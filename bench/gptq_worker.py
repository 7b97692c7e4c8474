"""One GPTQ run in its own process, for bench/gptq.py: llmpress or llm-compressor.

    python bench/gptq_worker.py TOOL MODEL_DIR TOKENS_PT BITS OUTPUT_DIR

Prints one JSON line: {"seconds": time from model load to saved checkpoint, "peak_rss_mb": the
process's peak resident memory, imports included}.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from common import peak_rss_mb


def scheme(bits: int) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}


def run_llmpress(model_dir: str, tokens: torch.Tensor, bits: int, output: str) -> None:
    import llmpress
    from llmpress.data import CalibrationOptions
    from llmpress.modifiers import GPTQModifier

    recipe = GPTQModifier(ignore=["lm_head"], config_groups=scheme(bits))
    options = CalibrationOptions(num_samples=tokens.shape[0], seq_len=tokens.shape[1], shuffle=False)
    llmpress.oneshot(model_dir, recipe, [row.tolist() for row in tokens], output_dir=output, calibration=options)


def run_llmcompressor(model_dir: str, tokens: torch.Tensor, bits: int, output: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    recipe = GPTQModifier(ignore=["lm_head"], config_groups=scheme(bits))
    oneshot(model=model, processor=tokenizer, dataset=dataset, recipe=recipe, num_calibration_samples=tokens.shape[0],
            max_seq_length=tokens.shape[1], output_dir=output)


def main() -> None:
    tool, model_dir, tokens_path, bits, output = sys.argv[1:6]
    tokens = torch.load(tokens_path)
    start = time.perf_counter()
    {"llmpress": run_llmpress, "llmcompressor": run_llmcompressor}[tool](model_dir, tokens, int(bits), output)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main()
