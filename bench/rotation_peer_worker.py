"""llm-compressor's side of ``bench/rotation.py``, run in its own environment (.venv-peers):
GPTQ alone and ``SpinQuantModifier`` + GPTQ on one scheme, each on a fresh float32 copy of the
model, calibrated on the same token ids, and the perplexity of the same windows measured on the
model as llm-compressor leaves it in memory (its fake quantization of weights and inputs on).

    python bench/rotation_peer_worker.py MODEL_DIR DATA.pt CONFIG_GROUPS_JSON ROTATIONS TRANSFORM_TYPE

``CONFIG_GROUPS_JSON`` is ``{"preset": "NVFP4"}`` for a preset scheme. ``DATA.pt`` holds ``{"batches": [[ids]...], "windows": LongTensor}``. Prints one JSON line:
``{"plain": [ppl, seconds], "rotated": [ppl, seconds] or {"error": ...}}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from common import peer_calibration
from perplexity_worker import perplexity


def run(model_dir: str, data: dict, groups: dict, rotations: list[str] | None, transform_type: str) -> list[float]:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SpinQuantModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calibration = peer_calibration(data["batches"])
    if "preset" in groups:
        recipe = [GPTQModifier(scheme=groups["preset"], targets=["Linear"], ignore=["lm_head"])]
    else:
        recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    if rotations:
        recipe.insert(0, SpinQuantModifier(rotations=rotations, transform_type=transform_type))
    start = time.perf_counter()
    oneshot(model=model, recipe=recipe, **calibration)
    seconds = time.perf_counter() - start
    return [perplexity(model, data["windows"]), seconds]


def main() -> None:
    model_dir, data_file, groups, rotations, transform_type = sys.argv[1:6]
    data = torch.load(data_file)
    groups = json.loads(groups)
    result = {"plain": run(model_dir, data, groups, None, transform_type)}
    try:
        result["rotated"] = run(model_dir, data, groups, rotations.split(","), transform_type)
    except Exception as exc:  # noqa: BLE001 -- the peer's refusal is a result
        result["rotated"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
