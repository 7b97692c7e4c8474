"""Perplexity of a checkpoint through transformers + compressed-tensors, in whichever virtual
environment runs it (llmpress's pins, or llm-compressor's: transformers 5.17 + ct 0.19); prints
one JSON line. The same computation as ``llmpress.evaluation.perplexity``: each window predicts
its last ``seq_len - 1`` tokens, exp of the mean negative log-likelihood.

    python bench/perplexity_worker.py CHECKPOINT WINDOWS.pt [--dtype bfloat16] [--logits OUT.pt]

``--dtype bfloat16`` loads in bf16 (compressed-tensors decompresses NVFP4 / MXFP4 to bf16 whatever
the model's dtype, so those checkpoints run only in bf16 there); ``--logits`` also saves the
logits of the first 4 windows (float32).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("windows")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--logits")
    args = parser.parse_args()
    windows = torch.load(args.windows)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
    if args.logits:
        torch.save(model(input_ids=windows[:4]).logits.float(), args.logits)
    scales = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if n.endswith(("k_scale", "v_scale"))})
    import transformers

    print(json.dumps({"perplexity": perplexity(model, windows), "transformers": transformers.__version__, "kv_scales": scales}))


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of each window's last ``seq_len - 1`` tokens."""
    total, count = 0.0, 0
    for batch in windows.split(8):
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
        count += targets.numel()
    return math.exp(total / count)


if __name__ == "__main__":
    main()
