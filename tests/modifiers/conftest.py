from __future__ import annotations

import pytest
import torch
from helpers import text_path, trained_model_dir


@pytest.fixture(scope="module")
def calibration_and_eval():
    """16 calibration sequences of 128 tokens and 4 held-out ones (a tensor), from the fixture's text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(trained_model_dir()))
    ids = tokenizer(text_path("calibration.txt").read_text(), add_special_tokens=False)["input_ids"]
    held_out = tokenizer(text_path("evaluation.txt").read_text()[:20000], add_special_tokens=False)["input_ids"]
    return [ids[i * 128 : (i + 1) * 128] for i in range(16)], torch.tensor([held_out[i * 128 : (i + 1) * 128] for i in range(4)])
