"""One measurement of bench/load_and_run.py, in its own process; prints one JSON line.

    python bench/load_worker.py load   --tool llmpress|transformers --model DIR
    python bench/load_worker.py decode --tool fp32|bf16|llmpress|transformers --model DIR [--new-tokens N]
    python bench/load_worker.py prefill --tool fp32|bf16|llmpress --model DIR [--tokens N]
    python bench/load_worker.py onload --model FP32_DIR --bits 4|8
    python bench/load_worker.py logits --tool llmpress|llmpress-exact|transformers --model DIR --out FILE
    python bench/load_worker.py llmc-compress --model FP32_DIR --out DIR   (in llm-compressor's venv)

Peak RSS is the process's high-water mark (VmHWM), imports included; times exclude imports.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import peak_rss_mb, prefill_seconds


def load(tool: str, model: str, quantization_config=None):
    if tool in ("llmpress", "llmpress-onload", "llmpress-exact", "llmpress-exact-fp64"):
        import llmpress

        # llmpress-exact: the dense view of the checkpoint in fp32 (no bf16 kernels); -fp64: in float64
        exact = tool.startswith("llmpress-exact")
        loaded = llmpress.load(model, quantization_config=quantization_config, dequantize=exact)
        return loaded.double() if tool == "llmpress-exact-fp64" else loaded
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if tool == "bf16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype)


def llmc_compress(model_dir: str, output: str) -> None:
    """llm-compressor's own W4A16 (group 128, symmetric) round-to-nearest checkpoint."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    recipe = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": {"targets": ["Linear"], "weights": weights}})
    oneshot(model=model, recipe=recipe, output_dir=output)


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task", choices=["load", "decode", "prefill", "onload", "logits", "llmc-compress"])
    parser.add_argument("--tool", default="llmpress")
    parser.add_argument("--model", required=True)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512, help="prompt length for prefill")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.task == "llmc-compress":
        llmc_compress(args.model, args.out)
        print(json.dumps({"peak_rss_mb": peak_rss_mb()}))
        return
    # imports are not timed, both tools pay them: transformers' lazy modules for Llama included
    import transformers.core_model_loading  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    if args.tool.startswith("llmpress"):
        import accelerate  # noqa: F401

        import llmpress  # noqa: F401
    elif args.tool == "transformers":
        import compressed_tensors  # noqa: F401
    result: dict = {}
    if args.task in ("load", "onload"):
        config = None
        if args.task == "onload":
            import llmpress

            config = llmpress.LlmpressConfig(bits=args.bits)
        start = time.perf_counter()
        model = load(args.tool, args.model, config)
        result["load_s"] = time.perf_counter() - start
        result["load_rss_mb"] = peak_rss_mb()
        with torch.no_grad():
            model(prompt(model.config.vocab_size))
        result["ready_s"] = time.perf_counter() - start
    elif args.task == "decode":
        model = load(args.tool, args.model)
        ids = prompt(model.config.vocab_size)
        settings = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **settings)  # warm-up (and lazy decompression)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **settings)
            elapsed = time.perf_counter() - start
        result["tokens_per_s"] = (out.shape[1] - ids.shape[1]) / elapsed
    elif args.task == "prefill":  # one forward of a batch-1 prompt, median of 3 after a warm-up
        result["prefill_s"] = prefill_seconds(load(args.tool, args.model), args.tokens)
    else:
        model = load(args.tool, args.model)
        ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.save(model(ids).logits.float(), args.out)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
