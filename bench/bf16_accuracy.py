"""Perplexity of the bf16 paths against the float32 path on the trained tiny model, and against llm-compressor on the same bf16 input.

    python bench/bf16_accuracy.py [--work DIR]

The trained tiny Llama (the fixture, float32), its copy cast to bf16, and that copy as a Hugging
Face fp8 checkpoint (128 x 128 block scales, DeepSeek-V3's layout). GPTQ W4A16 and RTN W4A16
(int4, groups of 128, lm_head dense; GPTQ on 64 x 256 calibration tokens): llmpress on the
float32 model, llmpress on the bf16 copy (read, calibrated and saved in bf16; and with its layers
calibrated in float32, ``--compute-dtype float32``, as on a CPU without bf16 units), llm-compressor on
the bf16 copy (loaded with ``dtype="auto"``), llmpress on the fp8 copy (dequantized as it is
read), each as a whole process (``gptq.run_worker``).
Every checkpoint's perplexity on the evaluation text is read through transformers +
compressed-tensors in float32, so the figures differ only by what each path computed; beside it,
the mean KL divergence of its next-token distributions from the unquantized bf16 copy's, on the
same text: a finer measure of how far quantization moved the model than perplexity, whose
differences of a few hundredths here are within one tool's run-to-run spread.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common import PEER_PYTHON, REPO, work_folder
from gptq import bench_inputs, gptq_recipe, run_worker, transformers_perplexity

from llmpress.evaluation import perplexity

sys.path.insert(0, str(REPO / "tests"))
from helpers import hf_fp8_copy  # noqa: E402  (the tests' maker of Hugging Face fp8 checkpoints)

RTN = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
"""


def bf16_copy(source: Path, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    if not (folder / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(torch.bfloat16).save_pretrained(str(folder))
        for file in source.glob("tokenizer*"):
            shutil.copy(file, folder / file.name)
    return folder


def float32_model(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def perplexity_and_kl(checkpoint: Path, windows, reference) -> tuple[float, float]:
    """The checkpoint's perplexity (read through transformers + compressed-tensors in float32)
    and its mean KL(reference || checkpoint) per predicted token, in one pass."""
    result = perplexity(float32_model(checkpoint), windows, reference=reference, progress=False)
    return result.perplexity, result.kl_divergence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-bf16-accuracy-")
    models, tokens, windows = bench_inputs(work, ["tiny"])
    fp32 = models["tiny"]
    bf16 = bf16_copy(fp32, work / "tiny-bf16")
    fp8 = work / "tiny-hf-fp8"
    if not (fp8 / "config.json").exists():
        hf_fp8_copy(bf16, fp8)
    recipes = {"GPTQ W4A16": gptq_recipe(work / "gptq-w4.yaml", 4), "RTN W4A16": work / "rtn-w4.yaml"}
    recipes["RTN W4A16"].write_text(RTN, encoding="utf-8")
    runs = {"llmpress, float32 model": (sys.executable, "llmpress", fp32), "llmpress, bf16 model": (sys.executable, "llmpress", bf16),
            "llmpress, bf16, float32 compute": (sys.executable, "llmpress-float32-compute", bf16),
            "llm-compressor, bf16 model": (PEER_PYTHON, "llmcompressor", bf16),
            "llmpress, HF fp8 copy": (sys.executable, "llmpress", fp8)}
    reference = float32_model(bf16)  # read once: its perplexity, and every output's KL from it
    print(f"unquantized: float32 {transformers_perplexity(fp32, windows):.3f}, "
          f"bf16 copy {perplexity(reference, windows, progress=False).perplexity:.3f}")
    for recipe_name, recipe in recipes.items():
        for run_name, (python, tool, model) in runs.items():
            output = work / f"{recipe.stem}-{tool}-{model.name}"
            if tool.endswith("float32-compute") and "GPTQ" not in recipe_name:
                continue  # RTN runs no forward: nothing to compute in float32
            run_worker(Path(python), tool, recipe, model, tokens, output)
            ppl, kl = perplexity_and_kl(output, windows, reference)
            print(f"{recipe_name:<11} {run_name:<32} perplexity {ppl:.3f}  KL from the bf16 copy {kl:.5f}", flush=True)


if __name__ == "__main__":
    main()
