"""Perplexity of several checkpoints on one text, as rows; and a bar chart of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpress.errors import DataError, MissingDependencyError
from llmpress.evaluation.perplexity import evaluation_windows, perplexity

__all__ = ["evaluate_models", "plot_results"]


def evaluate_models(
    models: list[str], dataset: str, *, seq_len: int = 256, max_windows: int = 200, batch_size: int = 8
) -> list[dict[str, Any]]:
    from llmpress.entrypoints import load_model_and_processor

    text_path = Path(dataset)
    if not text_path.is_file():
        raise DataError("evaluation text not found", got=str(text_path), expected="a text file")
    text = text_path.read_text(encoding="utf-8")
    rows, windows = [], None
    for path in models:
        model, tokenizer = load_model_and_processor(path)
        if tokenizer is None:
            raise DataError("the checkpoint has no tokenizer to read the text with", got=path, fix="save the tokenizer beside the model")
        windows = windows if windows is not None else evaluation_windows(text, tokenizer, seq_len, max_windows)
        result = perplexity(model, windows, batch_size=batch_size)
        rows.append({"model": path, **result.to_dict()})
    return rows


def plot_results(rows: list[dict[str, Any]], png: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib", fix="pip install matplotlib  (or 'llmpress[plot]')") from None
    labels = [Path(r["model"]).name for r in rows]
    values = [r["perplexity"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(rows)), 3.5))
    bars = ax.bar(labels, values, color="#4C72B0")
    ax.bar_label(bars, fmt="%.2f")
    low = min(values)
    ax.set_ylim(low * 0.95, max(values) * 1.03)
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(f"Perplexity, {rows[0]['windows']} windows of {rows[0]['seq_len']} tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)
