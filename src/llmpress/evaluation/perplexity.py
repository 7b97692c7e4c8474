"""Perplexity, computed the same way every time.

Tokenize without special tokens; take the first ``max_windows`` non-overlapping windows of
``seq_len`` tokens; each window predicts its last ``seq_len - 1`` tokens; perplexity is
``exp(mean negative log-likelihood)`` over all predicted tokens.
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

__all__ = ["PerplexityResult", "evaluation_windows", "perplexity"]


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int
    windows: int
    seq_len: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
) -> PerplexityResult:
    start = time.perf_counter()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    batches = windows.split(batch_size)
    for batch in tqdm(batches, desc="Perplexity", unit="batch", disable=None if progress else True, leave=False):
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total_nll += float(nll)
        total_tokens += targets.numel()
    return PerplexityResult(
        perplexity=math.exp(total_nll / total_tokens),
        tokens=total_tokens,
        windows=windows.shape[0],
        seq_len=windows.shape[1],
        seconds=time.perf_counter() - start,
    )
