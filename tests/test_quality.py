"""The trained model end to end: compress with each preset, save, read back through transformers
(with compressed-tensors, an independent reader) and through llmpress; perplexity must agree and
stay within a bound of fp32."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import text_path, trained_model_dir

from llmpress.cli import main
from llmpress.evaluation import evaluation_windows, perplexity

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~70 s: compress, save and read back the trained model

# perplexity bound relative to fp32 on the trained model (llm-compressor's RTN W4A16: +0.44%)
MAX_INCREASE = {"W4A16": 0.01, "W8A8": 0.005, "FP8": 0.01}
FORMATS = {"W4A16": "pack-quantized", "W8A8": "int-quantized", "FP8": "float-quantized"}
WINDOWS = 200


@pytest.fixture(scope="module")
def windows():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    return evaluation_windows(text_path("evaluation.txt").read_text(), tokenizer, 256, WINDOWS)


@pytest.fixture(scope="module")
def fp32_perplexity(windows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trained_model_dir()), dtype=torch.float32)
    return perplexity(model.eval(), windows, progress=False).perplexity


@pytest.mark.parametrize("preset", list(FORMATS))
def test_transformers_and_llmpress_agree(preset, tmp_path, windows, fp32_perplexity, capsys):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out = tmp_path / preset
    assert main(["oneshot", "--model", str(trained_model_dir()), "--recipe", preset, "--output", str(out),
                 "--dataset", str(text_path("calibration.txt"))]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == FORMATS[preset]
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--dataset", str(text_path("evaluation.txt")), "--json",
                 "--max-windows", str(WINDOWS)]) == 0
    ours = json.loads(capsys.readouterr().out)["perplexity"]

    theirs_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    theirs = perplexity(theirs_model, windows, progress=False).perplexity
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)
    assert ours / fp32_perplexity - 1 < MAX_INCREASE[preset], (ours, fp32_perplexity)


def test_gptq_recipe_file_through_the_cli(tmp_path, windows, fp32_perplexity, capsys):
    """llm-compressor's GPTQ recipe YAML, unchanged, through `llmpress oneshot --recipe FILE`:
    within 0.4% of fp32 (RTN W4A16 is +0.44% on this model), and transformers reads the same perplexity."""
    from helpers import REPO
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gptq"
    assert main(["oneshot", "--model", str(trained_model_dir()), "--recipe", str(REPO / "examples" / "recipes" / "gptq_w4a16.yaml"),
                 "--output", str(out), "--dataset", str(text_path("calibration.txt"))]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--dataset", str(text_path("evaluation.txt")), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["perplexity"]
    theirs = perplexity(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), windows, progress=False).perplexity
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)
    assert ours / fp32_perplexity - 1 < 0.004, (ours, fp32_perplexity)  # RTN W4A16: +0.44%
