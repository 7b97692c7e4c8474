"""llm-compressor's side of ``bench/autoround.py``, run in its own environment (.venv-peers):
its ``AutoRoundModifier`` (the ``auto-round`` package underneath) on one scheme, on a fresh
float32 copy of the model, calibrated on the same token ids, and the perplexity of the same
windows measured on the model as llm-compressor leaves it in memory (in float32: auto-round
tunes in bf16 where the CPU has bf16 units, and leaves the blocks in it).

    python bench/autoround_peer_worker.py MODEL_DIR DATA.pt CONFIG_GROUPS_JSON ITERS BATCH_SIZE

``CONFIG_GROUPS_JSON`` is ``{"preset": "NVFP4"}`` for a preset scheme. ``DATA.pt`` holds
``{"batches": [[ids]...], "windows": LongTensor}``. Prints one JSON line ``[perplexity, seconds]``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from common import peer_calibration
from perplexity_worker import perplexity


def main() -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from transformers import AutoModelForCausalLM

    model_dir, data_file, groups, iters, batch_size = sys.argv[1:6]
    data = torch.load(data_file)
    groups = json.loads(groups)
    fields = dict(iters=int(iters), batch_size=int(batch_size), ignore=["lm_head"])
    if "preset" in groups:
        modifier = AutoRoundModifier(scheme=groups["preset"], targets=["Linear"], **fields)
    else:
        modifier = AutoRoundModifier(config_groups=groups, **fields)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calibration = peer_calibration(data["batches"])
    start = time.perf_counter()
    oneshot(model=model, recipe=[modifier], **calibration)
    seconds = time.perf_counter() - start
    model.to(torch.float32)  # auto-round leaves the blocks in bf16 where the CPU has bf16 units (its amp)
    print(json.dumps([perplexity(model, data["windows"]), seconds]))


if __name__ == "__main__":
    main()
