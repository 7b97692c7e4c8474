"""kl_divergence: the mean KL of a compressed model's next-token distributions from its source's,
alone or in perplexity's own pass."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_tiny_llama
from torch import nn

import llmpress
from llmpress.errors import DataError
from llmpress.evaluation import kl_divergence, perplexity
from llmpress.modifiers import QuantizationModifier


class _Logits(nn.Module):
    """A model whose logits for a window are row ``window[0]`` of fixed ones."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.logits = logits

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.logits[input_ids[:, 0]]})()


def test_kl_divergence_is_the_mean_over_predicted_tokens_of_the_textbook_formula():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(3, 6, 11), torch.randn(3, 6, 11)
    windows = torch.arange(3).repeat_interleave(6).reshape(3, 6)
    p, q = p_logits[:, :-1].softmax(-1), q_logits[:, :-1].softmax(-1)
    expected = float((p * (p.log() - q.log())).sum(-1).mean())
    assert kl_divergence(_Logits(p_logits), _Logits(q_logits), windows, batch_size=2, progress=False) == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(_Logits(p_logits), _Logits(p_logits), windows, progress=False) == 0.0


def test_perplexity_with_a_reference_gives_the_same_perplexity_and_the_kl_in_one_pass():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(3, 6, 11), torch.randn(3, 6, 11)
    windows = torch.arange(3).repeat_interleave(6).reshape(3, 6)
    calls = []
    reference, model = _Logits(p_logits), _Logits(q_logits)
    for module in (reference, model):
        module.register_forward_hook(lambda module, args, out: calls.append(module))
    both = perplexity(model, windows, batch_size=2, progress=False, reference=reference)
    assert len(calls) == 4  # two batches, each through each model once
    alone = perplexity(model, windows, batch_size=2, progress=False)
    assert both.perplexity == alone.perplexity and alone.kl_divergence is None and "kl_divergence" not in alone.to_dict()
    assert both.kl_divergence == pytest.approx(kl_divergence(reference, model, windows, progress=False), rel=1e-6)


def test_kl_divergence_ranks_four_bits_above_eight():
    model = make_tiny_llama().eval()
    windows = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    batches = [row.tolist() for row in windows]
    kl = {scheme: kl_divergence(model, llmpress.oneshot(copy.deepcopy(model), QuantizationModifier(scheme=scheme, ignore=["lm_head"]),
                                                        batches), windows, progress=False)
          for scheme in ("W8A16", "W4A16")}
    assert 0 < kl["W8A16"] < kl["W4A16"] / 10


def test_kl_divergence_refuses_two_vocabularies():
    windows = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(DataError, match="one vocabulary"):
        kl_divergence(_Logits(torch.randn(1, 4, 8)), _Logits(torch.randn(1, 4, 9)), windows, progress=False)
