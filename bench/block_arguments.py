"""Each block on the inputs the model gives it: a 6-layer model of a family whose layers take
arguments of their own, its blocks run one by one on the captured inputs (as the calibration
pipeline runs them), against the model's own last hidden states.

    python bench/block_arguments.py [adopt]

With ``adopt`` each block takes its own arguments (``BlockArguments.adopt``, what the pipeline
does since 9b2c9ea); without, every block takes the first block's (what it did before).
"""
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from architectures import EXPERTS, MOE, SMALL
from helpers import token_batches
from transformers import AutoConfig, AutoModelForCausalLM

from llmpress.contract.block import find_blocks, hidden_of
from llmpress.contract.observation import Observation, primary_input
from llmpress.pipelines.blocks import capture_block_inputs, hand_on, share_repeated

for fam, extra, n in [("gpt_oss", {**EXPERTS["gpt_oss"], **MOE}, 200), ("gemma2", {"head_dim": 32, "sliding_window": 64}, 100), ("gemma3_text", {"head_dim": 32, "sliding_window": 64}, 100)]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fam, **{**SMALL, **extra, "num_hidden_layers": 6, "max_position_embeddings": 512})).eval()
    blocks = find_blocks(model)
    batches = [torch.tensor([b]) for b in token_batches(2, n, vocab=4096)]
    expected = []
    h = blocks[-1].register_forward_hook(lambda _m, _a, o: expected.append(hidden_of(o)))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    h.remove()
    with torch.no_grad():
        inputs, _, arguments = capture_block_inputs(model, blocks, batches, torch.device("cpu"), Observation([]))
        share_repeated(inputs)
        for i, block in enumerate(blocks):
            if arguments is not None and "adopt" in sys.argv:
                arguments.adopt(inputs, i)
            for b in range(len(inputs)):
                hand_on(inputs, b, block(*inputs[b][0], **inputs[b][1]))
    err = max(float((primary_input(*inputs[b]) - e).abs().max()) for b, e in enumerate(expected))
    scale = max(float(e.abs().max()) for e in expected)
    print(f"{fam}: blocks with their own arguments {None if arguments is None else arguments.differs}, "
          f"largest difference from the model's own {err:.4g} ({err / scale:.1%} of its largest value)")
