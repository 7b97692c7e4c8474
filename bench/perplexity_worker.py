"""Perplexity of a checkpoint through transformers + compressed-tensors, in whichever virtual
environment runs it (llmpress's pins, or llm-compressor's: transformers 5.17 + ct 0.19); prints
one JSON line. The same computation as ``llmpress.evaluation.perplexity``: each window predicts
its last ``seq_len - 1`` tokens, exp of the mean negative log-likelihood.

    python bench/perplexity_worker.py CHECKPOINT WINDOWS.pt
"""

from __future__ import annotations

import json
import math
import sys

import torch
from transformers import AutoModelForCausalLM


@torch.no_grad()
def main() -> None:
    checkpoint, windows_path = sys.argv[1:3]
    windows = torch.load(windows_path)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    scales = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if n.endswith(("k_scale", "v_scale"))})
    total, count = 0.0, 0
    for batch in windows.split(8):
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
        count += targets.numel()
    import transformers

    print(json.dumps({"perplexity": math.exp(total / count), "transformers": transformers.__version__, "kv_scales": scales}))


if __name__ == "__main__":
    main()
