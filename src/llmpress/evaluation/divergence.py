"""How far a compressed model's next-token distributions are from the model it came from.

Perplexity on a small model moves up and down with a rounding's luck: at 4 bits its rise is
often below the spread between two calibration draws, and can be negative. The mean
Kullback-Leibler divergence ``KL(P_reference || P_model)`` over the same windows is zero only
for the same distributions and grows with every error, so it ranks two compressions of one
model where perplexity cannot (llama.cpp's ``--kl-divergence`` reports the same quantity).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import DataError

__all__ = ["kl_divergence"]


@torch.no_grad()
def kl_divergence(reference: nn.Module, model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: bool = True) -> float:
    """Mean ``KL(P_reference || P_model)`` in nats per predicted token over ``windows`` (the
    ``[windows, seq_len]`` ids of ``evaluation_windows``; each window predicts its last
    ``seq_len - 1`` tokens, as perplexity counts them). The two models must share a vocabulary."""
    total, tokens = 0.0, 0
    for batch in tqdm(windows.split(batch_size), desc="KL divergence", unit="batch", disable=None if progress else True, leave=False):
        log_p = _log_probs(reference, batch)
        log_q = _log_probs(model, batch)
        if log_p.shape != log_q.shape:
            raise DataError("KL divergence needs two models over one vocabulary", got=f"logits {tuple(log_p.shape)} and {tuple(log_q.shape)}",
                            expected="the same shape", fix="compare a model with its own compressed copy")
        total += float((log_p.exp() * (log_p - log_q)).sum())
        tokens += log_p.shape[0] * log_p.shape[1]
    return total / max(1, tokens)


def _log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.log_softmax(model(input_ids=batch.to(device)).logits[:, :-1].float(), dim=-1).cpu()
