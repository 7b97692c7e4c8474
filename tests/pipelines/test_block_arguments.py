"""Blocks called with arguments of their own: Gemma 3's global layers take their own rotary
tables (another base frequency) and mask, gpt-oss's sliding layers their window's mask, and the
calibration must give each block what the model gives it, not the first block's."""

from __future__ import annotations

import pytest
import torch
from architectures import SMALL
from helpers import token_batches

from llmpress.contract.block import find_blocks, hidden_of
from llmpress.contract.observation import Observation, primary_input
from llmpress.pipelines.blocks import capture_block_inputs, hand_on, share_repeated
from llmpress.pipelines.storage.kept import close_spill_files

#: families whose layers get arguments of their own, the tokens a batch takes, and which blocks:
#: Gemma 3's last of six is a global layer (its own rotary tables and mask); gpt-oss alternates
#: sliding and full layers (their own masks past the sliding window of 128 tokens)
FAMILIES = {
    "gemma3_text": ({"head_dim": 32}, 16, [False] * 5 + [True]),
    "gpt_oss": ({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "head_dim": 32,
                 "max_position_embeddings": 512}, 160, [False, True] * 3),
}


@pytest.mark.parametrize("spilled", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_each_block_runs_on_what_the_model_gives_it(tmp_path, family, spilled):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields, tokens, own = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**SMALL, **fields, "num_hidden_layers": 6})).eval()
    blocks = find_blocks(model)
    batches = [torch.tensor([b]) for b in token_batches(2, tokens, vocab=4096)]
    expected = []
    hook = blocks[-1].register_forward_hook(lambda _m, _a, output: expected.append(hidden_of(output)))
    for batch in batches:
        model(input_ids=batch)
    hook.remove()
    inputs, _, arguments = capture_block_inputs(model, blocks, batches, torch.device("cpu"), Observation([]),
                                                tmp_path if spilled else None)
    share_repeated(inputs)
    assert arguments is not None and arguments.differs == own
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
