"""llm-compressor's recipe with ``targets: [Linear, Embedding]`` (its new_quant_weight.yaml):
llmpress keeps the embedding dense and says so, and the saved config names only the targets that
reached a quantized module, so transformers + compressed-tensors loads the file (it failed on
"'Embedding' object has no attribute 'weight'" when the config still named Embedding)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import make_tiny_llama

import llmpress

RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear, Embedding]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: tensor}
"""


def test_embedding_target_loads_everywhere(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    with caplog.at_level(logging.WARNING):
        model = llmpress.oneshot(make_tiny_llama(), RECIPE, output_dir=tmp_path / "q")
    assert "model.embed_tokens (Embedding)" in caplog.text and "full precision" in caplog.text
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["Linear"]]
    ids = torch.tensor([[1, 2, 3, 4]])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype=torch.float32).eval()
    ours = llmpress.load(tmp_path / "q", dequantize=True)
    with torch.no_grad():
        a, b, c = ours(input_ids=ids).logits, theirs(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
