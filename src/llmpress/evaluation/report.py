"""Perplexity of several checkpoints on one text and their lm-eval task scores, as rows; and a bar
chart of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmpress.data import load_records
from llmpress.errors import DataError, MissingDependencyError
from llmpress.evaluation.perplexity import evaluation_windows, perplexity
from llmpress.evaluation.tasks import task_scores
from llmpress.loading.inspect import describe_args
from llmpress.loading.loader import load, model_folder, read_model_and_processor, read_tokenizer
from llmpress.quant.presets import PRESET_SCHEMES, preset_scheme
from llmpress.quant.scheme import QuantizationScheme

__all__ = ["evaluate_models", "format_table", "plot_results", "scheme_label", "task_columns"]

_NOT_THE_GRID = {"observer", "observer_kwargs", "actorder", "zp_dtype"}  # how a grid was chosen, not which


def _grid(args) -> dict | None:
    return None if args is None else args.model_dump(mode="json", exclude=_NOT_THE_GRID)


def scheme_label(folder: str | Path) -> str:
    """What a checkpoint holds, in a few words: ``NVFP4A16`` (a preset's name where a config
    group is one), the scheme described otherwise, or ``dense float32``."""
    import json

    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    if not groups:
        return f"dense {config.get('dtype') or config.get('torch_dtype') or ''}".strip()
    presets = {name: preset_scheme(name) for name in PRESET_SCHEMES}
    labels = []
    for group in groups.values():
        scheme = QuantizationScheme(**{k: v for k, v in group.items() if k not in ("format", "targets")})
        grid = (_grid(scheme.weights), _grid(scheme.input_activations))
        named = [name for name, p in presets.items() if (_grid(p.weights), _grid(p.input_activations)) == grid]
        parts = [describe_args(scheme.weights, "weights"), describe_args(scheme.input_activations, "inputs")]
        labels.append(named[0] if named else ", ".join(p for p in parts if p))
    return "; ".join(dict.fromkeys(labels))


def evaluate_models(
    models: list[str], dataset: str | None, *, seq_len: int = 256, max_windows: int = 200, batch_size: int = 8,
    dtype: torch.dtype = torch.float32, trust_remote_code: bool = False, tasks: list[str] | None = None,
    include_path: str | None = None, limit: int | None = None, kl: bool = False,
) -> list[dict[str, Any]]:
    """One row per checkpoint: its perplexity on ``dataset`` (computed in ``dtype``), its scores
    on lm-eval ``tasks`` (the model ``llmpress.load`` gives: the CPU kernels), what it holds and
    the size of its weight files. ``kl``: also the mean KL divergence of each model's next-token
    distributions from the first model's on the same windows (the first stays in memory)."""
    if dataset is None and not tasks:
        raise DataError("nothing to evaluate", got="no dataset and no tasks", expected="a text file (perplexity), lm-eval tasks, or both")
    if kl and dataset is None:
        raise DataError("the KL divergence is measured on the perplexity text", got="--kl without --dataset", fix="add --dataset TEXT")
    text = evaluation_text(Path(dataset), seq_len * max_windows) if dataset is not None else None
    rows, windows, reference = [], None, None
    for path in models:
        folder = model_folder(path)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        row: dict[str, Any] = {"model": path, "scheme": scheme_label(folder), "weights_mb": size}
        if text is not None:
            model, tokenizer = read_model_and_processor(path, dtype=dtype, trust_remote_code=trust_remote_code)
            if tokenizer is None:
                raise DataError("the checkpoint has no tokenizer to read the text with", got=path, fix="save the tokenizer beside the model")
            windows = windows if windows is not None else evaluation_windows(text, tokenizer, seq_len, max_windows)
            if kl and reference is None:  # the first model: the one every later row is compared with
                reference = model
            result = perplexity(model, windows, batch_size=batch_size, reference=None if model is reference else reference)
            row.update(result.to_dict())
            if kl:
                row["kl_vs_first"] = row.pop("kl_divergence", 0.0)  # 0 for the first model itself
            del model
        if tasks:
            runtime = load(path, trust_remote_code=trust_remote_code)
            row["tasks"] = task_scores(runtime, read_tokenizer(folder, trust_remote_code), tasks, include_path=include_path,
                                       limit=limit, batch_size=batch_size)
        rows.append(row)
    return rows


def task_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(task, metric) pairs the rows hold, in order."""
    return list(dict.fromkeys((t, m) for r in rows for t, metrics in (r.get("tasks") or {}).items() for m in metrics))


def evaluation_text(path: Path, tokens: int) -> str:
    """The text to score: a text file, or the ``text`` fields of a JSON-lines / JSON file's
    records (not the raw JSON), read as far as ``tokens`` tokens can need (16 characters each)."""
    if not path.is_file():
        raise DataError("evaluation text not found", got=str(path), expected="a text, JSON-lines or JSON file")
    limit = 16 * tokens
    try:
        if path.suffix in (".jsonl", ".json"):
            records = load_records(path, None)
            texts = [r.get("text") if isinstance(r, dict) else r for r in records]
            if not all(isinstance(t, str) for t in texts):
                raise DataError(f"{path} has records without text", expected="records with a 'text' field")
            return "\n\n".join(texts)[:limit]
        with open(path, encoding="utf-8") as handle:
            return handle.read(limit)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text", got=str(exc)[:200], expected="a UTF-8 text file") from None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned table: each perplexity also against the first row's, then each
    task's metrics."""
    names = [Path(r["model"]).name or r["model"] for r in rows]
    width, scheme_width = max(5, *map(len, names)), max(6, *(len(r["scheme"]) for r in rows))
    columns = task_columns(rows)
    labels = [f"{t} {m}" for t, m in columns]
    has_ppl, has_kl = "perplexity" in rows[0], "kl_vs_first" in rows[0]
    head = f"{'model':<{width}}  {'scheme':<{scheme_width}}  {'weights MB':>10}"
    head += f"  {'perplexity':>10}  {'vs first':>8}" if has_ppl else ""
    head += f"  {'KL vs first':>11}" if has_kl else ""
    lines = [head + "".join(f"  {label:>{max(8, len(label))}}" for label in labels)]
    for name, row in zip(names, rows):
        line = f"{name:<{width}}  {row['scheme']:<{scheme_width}}  {row['weights_mb']:>10.1f}"
        if has_ppl:
            change = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1)
            line += f"  {row['perplexity']:>10.3f}  {change:>+7.2f}%"
        if has_kl:
            line += f"  {row['kl_vs_first']:>11.3e}"
        for (task, metric), label in zip(columns, labels):
            value = (row.get("tasks") or {}).get(task, {}).get(metric)
            line += f"  {'-' if value is None else f'{value:.4f}':>{max(8, len(label))}}"
        lines.append(line)
    first = rows[0]
    if has_ppl:
        lines.append(f"({first['windows']} windows of {first['seq_len']} tokens, {first['tokens']} tokens predicted"
                     + ("; KL: mean nats per token from the first model's next-token distributions)" if has_kl else ")"))
    return "\n".join(lines)


def plot_results(rows: list[dict[str, Any]], png: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib", fix="pip install matplotlib  (or 'llmpress[plot]')") from None
    labels = [f"{Path(r['model']).name}\n{r['scheme']}" if "scheme" in r else Path(r["model"]).name for r in rows]
    panels = ([("perplexity", "perplexity (lower is better)", [r["perplexity"] for r in rows])] if "perplexity" in rows[0] else [])
    if "kl_vs_first" in rows[0]:
        panels.append(("kl", "KL divergence from the first model, nats per token (lower is better)", [r["kl_vs_first"] for r in rows]))
    panels += [(f"{t} {m}", f"{t} {m} (higher is better)", [(r.get("tasks") or {}).get(t, {}).get(m, float("nan")) for r in rows])
               for t, m in task_columns(rows)]
    # horizontal bars, first model on top: long checkpoint names stay readable; one panel per measure
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, (1.2 + 0.6 * len(rows)) * len(panels)), squeeze=False)
    positions = range(len(rows))  # positions, not the labels themselves: two folders may share a name
    for ax, (name, axis_label, values) in zip(axes[:, 0], panels):
        bars = ax.barh(positions, values[::-1], color="#4C72B0")
        ax.set_yticks(positions, labels[::-1])
        ax.bar_label(bars, fmt="%.2e" if name == "kl" else "%.3f", padding=3)
        finite = [v for v in values if v == v]
        if name == "perplexity" and finite:
            ax.set_xlim(min(finite) * 0.98, max(finite) * 1.01)
            ax.set_title(f"Perplexity, {rows[0]['windows']} windows of {rows[0]['seq_len']} tokens")
        elif name == "kl":
            ax.set_xlim(0, max([1e-9, *finite]) * 1.3)  # room for the labels in scientific notation
            ax.set_title("KL divergence from the first model")
        else:
            ax.set_xlim(0, max([1.0, *finite]) * 1.1)
            ax.set_title(name)
        ax.set_xlabel(axis_label)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)
