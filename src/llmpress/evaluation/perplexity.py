"""Perplexity, and the KL divergence from a reference model, computed the same way every time.

Tokenize without special tokens; take the first ``max_windows`` non-overlapping windows of
``seq_len`` tokens; each window predicts its last ``seq_len - 1`` tokens; perplexity is
``exp(mean negative log-likelihood)`` over all predicted tokens.

Perplexity on a small model moves up and down with a rounding's luck: at 4 bits its rise is
often below the spread between two calibration draws, and can be negative. The mean
Kullback-Leibler divergence ``KL(P_reference || P_model)`` over the same windows is zero only
for the same distributions and grows with every error, so it ranks two compressions of one
model where perplexity cannot (llama.cpp's ``--kl-divergence`` reports the same quantity). Both
come from one pass: each batch runs through the model (and the reference) once.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from llmpress.errors import DataError

__all__ = ["PerplexityResult", "evaluation_windows", "kl_divergence", "perplexity"]


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int
    windows: int
    seq_len: int
    seconds: float
    kl_divergence: float | None = None  # mean KL(P_reference || P_model), nats per token, when a reference was given

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def evaluation_windows(text: str, tokenizer: Any, seq_len: int = 256, max_windows: int = 200) -> torch.Tensor:
    """``[windows, seq_len]`` token ids: the first non-overlapping windows of the text."""
    if seq_len < 2 or max_windows < 1:
        raise DataError(
            "perplexity needs windows of at least 2 tokens, and at least one window",
            got=f"seq_len={seq_len}, max_windows={max_windows}",
            expected="seq_len >= 2, max_windows >= 1",
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = min(len(ids) // seq_len, max_windows)
    if count < 1:
        raise DataError(
            "the evaluation text is shorter than one window",
            got=f"{len(ids)} tokens",
            expected=f"at least seq_len={seq_len} tokens",
            fix="give a longer text or a smaller --seq-len",
        )
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).reshape(count, seq_len)


@torch.no_grad()
def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 8,
    progress: bool = True,
    reference: nn.Module | None = None,
) -> PerplexityResult:
    """The model's perplexity on ``windows`` (``[windows, seq_len]`` ids of ``evaluation_windows``).
    ``reference``: also the mean ``KL(P_reference || P_model)`` on the same predicted tokens, in
    the same pass (the two models must share a vocabulary)."""
    start = time.perf_counter()
    total_nll, total_kl, total_tokens = 0.0, 0.0, 0
    for batch in tqdm(windows.split(batch_size), desc="Perplexity", unit="batch", disable=None if progress else True, leave=False):
        log_q = _log_probs(model, batch)
        targets = batch[:, 1:].to(log_q.device)
        total_nll += float(nn.functional.nll_loss(log_q.reshape(-1, log_q.shape[-1]), targets.reshape(-1), reduction="sum"))
        total_tokens += targets.numel()
        if reference is not None:
            log_p = _log_probs(reference, batch).to(log_q.device)
            if log_p.shape != log_q.shape:
                raise DataError("KL divergence needs two models over one vocabulary", got=f"logits {tuple(log_p.shape)} and {tuple(log_q.shape)}",
                                expected="the same shape", fix="compare a model with its own compressed copy")
            total_kl += float((log_p.exp() * (log_p - log_q)).sum())
    return PerplexityResult(
        perplexity=math.exp(total_nll / total_tokens),
        tokens=total_tokens,
        windows=windows.shape[0],
        seq_len=windows.shape[1],
        seconds=time.perf_counter() - start,
        kl_divergence=None if reference is None else total_kl / total_tokens,
    )


def kl_divergence(reference: nn.Module, model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: bool = True) -> float:
    """Mean ``KL(P_reference || P_model)`` in nats per predicted token over ``windows``: zero for
    the same distributions, larger with every error (the module docstring says why it ranks
    compressions better than perplexity). ``perplexity(..., reference=...)`` gives both at once."""
    result = perplexity(model, windows, batch_size=batch_size, progress=progress, reference=reference)
    assert result.kl_divergence is not None
    return result.kl_divergence


def _log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Log-probabilities, in float32, of each window's next tokens but the last position's."""
    device = next(model.parameters()).device
    return torch.log_softmax(model(input_ids=batch.to(device)).logits[:, :-1].float(), dim=-1)
