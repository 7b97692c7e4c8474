"""Blocks called with arguments of their own: Gemma 3's global layers take their own rotary
tables (another base frequency) and mask, and the calibration must give each block what the
model gives it, not the first block's."""

from __future__ import annotations

import pytest
import torch
from architectures import SMALL
from helpers import token_batches

from llmpress.contract.block import find_blocks, hidden_of
from llmpress.contract.observation import Observation, primary_input
from llmpress.pipelines.blocks import capture_block_inputs, hand_on, share_repeated
from llmpress.pipelines.storage.kept import close_spill_files


def _gemma3():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3_text", **{**SMALL, "head_dim": 32, "num_hidden_layers": 6})
    assert config.layer_types[-1] == "full_attention" and config.layer_types[0] == "sliding_attention"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("spilled", [False, True])
@torch.no_grad()
def test_each_block_runs_on_what_the_model_gives_it(tmp_path, spilled):
    model = _gemma3()
    blocks = find_blocks(model)
    batches = [torch.tensor([b]) for b in token_batches(2, 16, vocab=4096)]
    expected = []
    hook = blocks[-1].register_forward_hook(lambda _m, _a, output: expected.append(hidden_of(output)))
    for batch in batches:
        model(input_ids=batch)
    hook.remove()
    inputs, _, arguments = capture_block_inputs(model, blocks, batches, torch.device("cpu"), Observation([]),
                                                tmp_path if spilled else None)
    share_repeated(inputs)
    assert arguments is not None and arguments.differs == [False] * 5 + [True]  # the global layer's own
    try:
        for index, block in enumerate(blocks):
            arguments.adopt(inputs, index)
            for batch in range(len(inputs)):
                hand_on(inputs, batch, block(*inputs[batch][0], **inputs[batch][1]))
        for batch, output in enumerate(expected):
            torch.testing.assert_close(primary_input(*inputs[batch]), output, rtol=0, atol=0)
    finally:
        close_spill_files()


def test_blocks_called_alike_keep_no_arguments_of_their_own():
    from helpers import make_tiny_llama

    model = make_tiny_llama()
    batches = [torch.tensor([b]) for b in token_batches(2, 16)]
    _, _, arguments = capture_block_inputs(model, find_blocks(model), batches, torch.device("cpu"), Observation([]))
    assert arguments is None
