"""One llmpress measurement for bench/cpu_decode.py, in its own process (prints one JSON line).

    python bench/cpu_decode_worker.py --model FP32_DIR --variant int4 [--compile] [--new-tokens 32] [--prefill 512]

Variants: ``fp32`` and ``bf16`` (the dense model), ``int8`` and ``int4`` (quantize-on-load,
``lm_head`` in full precision; the rest of the model in bf16 and float32, the quantizer's
defaults), ``int4-bf16`` (the same in bf16, ``dtype=torch.bfloat16``: prefill products in bf16
where the CPU has native bf16), ``int4-all`` (the output projection in int4 too, as llama.cpp
quantizes it). Measures the load, greedy decode at batch 1 from a one-token prompt (as
llama-bench's tg: no prompt to process), one prefill forward (median of 3), which kernel each linear runs on,
and for quantized variants the logits against the same weights dequantized in float32.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from common import prefill_seconds

VARIANTS = ("fp32", "bf16", "int8", "int4", "int4-bf16", "int4-all")


def load(model: str, variant: str, compile_decode: bool):
    import llmpress

    if variant in ("fp32", "bf16"):
        return llmpress.load(model, dtype=torch.float32 if variant == "fp32" else torch.bfloat16, compile_decode=compile_decode)
    bits = 8 if variant == "int8" else 4
    dtype = torch.bfloat16 if variant == "int4-bf16" else None
    config = llmpress.LlmpressConfig(bits=bits, lm_head=variant == "int4-all")
    return llmpress.load(model, dtype=dtype, quantization_config=config, compile_decode=compile_decode)


def logits_gap(model) -> float:
    """Relative L2 distance of the logits from the same quantized weights, dense, in float32."""
    from llmpress.loading.dense import dequantize_model

    reference = dequantize_model(copy.deepcopy(model)).float()
    ids = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    gaps = []
    with torch.no_grad():
        for tokens in (1, 64):  # a decode-sized and a prefill-sized product
            got, want = model(ids[:, :tokens]).logits.float(), reference(ids[:, :tokens]).logits.float()
            gaps.append(float((got - want).norm() / want.norm()))
    return max(gaps)


def decode(model, new_tokens: int, compile_decode: bool) -> dict:
    settings = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    ids = torch.tensor([[1]])
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)  # warm-up (compiles)
        first = time.perf_counter() - start
        rates = []
        for _ in range(3):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)
            rates.append(new_tokens / (time.perf_counter() - start))
    rate = sorted(rates)[1]
    return {"tokens_per_s": rate, "first_generate_s": first, "compile_s": max(0.0, first - new_tokens / rate) if compile_decode else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="decode through torch.compile (static cache) from the first call (llmpress.load's default waits for 1024 tokens)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports are not timed)

    import llmpress  # noqa: F401
    from llmpress import native
    from llmpress.runtime.decode import kernel_report

    native.available()  # built once beforehand: the build is not the load
    start = time.perf_counter()
    model = load(args.model, args.variant, args.compile)
    result = {"variant": args.variant, "load_s": time.perf_counter() - start, "kernels": kernel_report(model)}
    if args.variant.startswith("int"):
        result["logits_gap"] = logits_gap(model)
    result.update(decode(model, args.new_tokens, args.compile))
    if args.prefill:
        result["prefill_tokens_per_s"] = args.prefill / prefill_seconds(model, args.prefill)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
