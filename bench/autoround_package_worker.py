"""The ``auto-round`` package on its own (its ``AutoRound`` entry point, not llm-compressor's
modifier), for ``bench/autoround.py --package``, run in the peers' environment (.venv-peers): one
scheme on a fresh float32 copy of the model, calibrated on the same token ids with the same steps
and batch size, and the perplexity of the same windows on the model as auto-round leaves it in
memory (each tuned weight written back on its grid, in float32 here).

    python bench/autoround_package_worker.py MODEL_DIR DATA.pt CONFIG_GROUPS_JSON ITERS BATCH_SIZE

``CONFIG_GROUPS_JSON``: ``bench/autoround.py``'s groups (``{"preset": "NVFP4"}``, or one group of
integer weights, inputs left as they are). Prints one JSON line ``[perplexity, seconds]``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from perplexity_worker import perplexity


def scheme_of(groups: dict) -> str | dict:
    """auto-round's scheme for the row: a preset by name, or integer weights in groups."""
    if "preset" in groups:
        return groups["preset"]
    (group,) = groups.values()
    weights, inputs = group["weights"], group.get("input_activations")
    if inputs:
        raise SystemExit("this worker runs weight-only and preset rows (auto-round's own activation schemes differ)")
    return dict(bits=weights["num_bits"], group_size=weights.get("group_size") or -1, sym=weights.get("symmetric", True),
                data_type="int", act_bits=16)


def main() -> None:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_file, groups, iters, batch_size = sys.argv[1:6]
    data = torch.load(data_file)
    samples = [torch.tensor([ids]) for ids in data["batches"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = time.perf_counter()
    tuner = AutoRound(model, tokenizer, scheme=scheme_of(json.loads(groups)), dataset=samples, iters=int(iters),
                      seqlen=samples[0].shape[-1], nsamples=len(samples), batch_size=int(batch_size), device_map="cpu")
    model, _ = tuner.quantize()
    seconds = time.perf_counter() - start
    model.to(torch.float32)  # tuned in bf16 under its amp where the CPU has bf16 units
    print(json.dumps([perplexity(model, data["windows"]), seconds]))


if __name__ == "__main__":
    main()
