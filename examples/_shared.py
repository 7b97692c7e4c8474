"""What the pruning examples share: arguments, data, and the before/after report.

Only the part that differs (Trainer or plain loop) lives in each example.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import llmpress
from llmpress.checkpoint.sparsity import SPARSITY_KEY
from llmpress.data import CalibrationOptions, load_calibration_samples
from llmpress.evaluation import evaluation_windows, perplexity
from llmpress.lifecycle.sparsity import sparsity_of
from llmpress.loading.loader import read_model_and_processor

RECIPE = Path(__file__).resolve().parent / "recipes" / "prune_50_distill.yaml"


def parse_args(description: str, extra: list[tuple[str, dict]] = ()) -> argparse.Namespace:
    """The examples' common arguments, and ``extra`` ones (``(flag, add_argument keywords)``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="model folder (dense)")
    parser.add_argument("--text", required=True, help="training text (the calibration text)")
    parser.add_argument("--output", required=True, help="folder for the pruned checkpoint")
    parser.add_argument("--eval-text", help="evaluation text (default: evaluation.txt beside --text)")
    parser.add_argument("--recipe", default=str(RECIPE), help="pruning recipe (YAML)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-samples", type=int, help="use at most this many training samples")
    parser.add_argument("--max-windows", type=int, default=50, help="evaluation windows of 256 tokens")
    parser.add_argument("--seed", type=int, default=0)
    for flag, keywords in extra:
        parser.add_argument(flag, **keywords)
    args = parser.parse_args()
    if args.eval_text is None:
        beside = Path(args.text).with_name("evaluation.txt")
        args.eval_text = str(beside if beside.exists() else args.text)
    return args


def load_everything(args: argparse.Namespace):
    """The model, its tokenizer, training samples (1-D token tensors) and evaluation windows."""
    torch.manual_seed(args.seed)
    model, tokenizer = read_model_and_processor(args.model)
    options = CalibrationOptions(num_samples=args.max_samples, seq_len=args.seq_len, seed=args.seed)
    samples = load_calibration_samples(args.text, tokenizer, options)
    windows = evaluation_windows(Path(args.eval_text).read_text(encoding="utf-8"), tokenizer, 256, args.max_windows)
    return model, tokenizer, samples, windows


def report(before: float, output: str | Path, windows: torch.Tensor) -> dict:
    """Reload the checkpoint, measure it, print a before/after table; return the figures."""
    model = llmpress.load_checkpoint(output)
    config = json.loads((Path(output) / "config.json").read_text())
    # a quantized checkpoint records it in quantization_config, a pruned-only one under llmpress's key
    sparse = config.get("quantization_config", {}).get("sparsity_config") or config.get(SPARSITY_KEY) or {}
    modules = dict(model.named_modules())
    sparsity = {name: sparsity_of(modules[name]) for name in sparse.get("targets", [])}
    after = perplexity(model, windows, progress=False).perplexity
    low, high = (min(sparsity.values()), max(sparsity.values())) if sparsity else (0.0, 0.0)
    print(f"\n{'model':<28}{'perplexity':>12}{'sparsity':>22}")
    print(f"{'dense (before)':<28}{before:>12.2f}{'0%':>22}")
    print(f"{'pruned (checkpoint)':<28}{after:>12.2f}{f'{low:.1%} .. {high:.1%}':>22}")
    print(f"{len(sparsity)} pruned modules, structure {sparse.get('sparsity_structure')}; checkpoint: {output}")
    return {"before": before, "after": after, "sparsity": sparsity}
