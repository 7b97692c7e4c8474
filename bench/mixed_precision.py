"""Mixed precision to a budget (issue 44): a scheme per module chosen by sensitivity, against every
uniform scheme near the same size, all with one algorithm (GPTQ by default).

    python bench/mixed_precision.py [--model DIR] [--dtype bfloat16] [--targets 3.5 4.25] [--seeds 0 1]
                                    [--samples 64] [--seq-len 256] [--menu W3A16,W4A16,...] [--windows 40]
                                    [--algorithm gptq|awq|rtn]

Every row runs once per seed: the algorithm (GPTQ: static column order; AWQ: llm-compressor's
example's search, ``duo_scaling`` and a grid of 20, then the rounding to nearest; RTN: the rounding
to nearest alone; ``lm_head`` as it is) on ``--samples``
windows of the shared calibration text drawn with that seed, the checkpoint saved, its bytes and
the perplexity of ``--windows`` held-out windows of 256 tokens of the shared evaluation text (40;
the tiny model's text holds 134) measured with
the model in float32, and the mean KL divergence of its next-token distributions from the
unquantized model's on those windows (lower noise than perplexity: it cannot fall below zero by
luck); the table gives each seed's perplexity, their mean, and the mean KL. The uniform rows
are the int weight-only schemes of 3 and 4 bits in groups of 128, 64 and 32 (a group that does
not divide a module's columns falls back as the recipe would: SmolLM2's 576 takes 64 for 128);
the mixed rows choose from ``--menu`` (default: the modifier's own for the target) at each target
of average bits per targeted weight. Last,
how many modules got the same scheme under every seed. The model is read in ``--dtype`` (default the checkpoint's own; the scales, and the
modules left dense, are stored in it, and bits per weight count them).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import fixture

import llmpress
from llmpress.evaluation import evaluation_windows, perplexity
from llmpress.modifiers import AWQModifier, GPTQModifier, QuantizationModifier
from llmpress.modifiers.mixed_precision.menu import default_menu, menu_option, weight_bits

UNIFORM = ("W3A16", "W3A16_G64", "W3A16_G32", "W4A16", "W4A16_G64", "W4A16_G32")


def load(model_dir: str, dtype: str | None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype) if dtype else "auto").eval()


def calibration(tokenizer, samples: int, seq_len: int, seed: int) -> list[list[int]]:
    ids = tokenizer(fixture("text", "calibration.txt").read_text(), add_special_tokens=False)["input_ids"]
    windows = [ids[i * seq_len:(i + 1) * seq_len] for i in range(len(ids) // seq_len)]
    return random.Random(seed).sample(windows, min(samples, len(windows)))


def average_bits(model, scheme_name: str) -> float:
    """Bits per targeted weight (every Linear but lm_head) under one uniform scheme."""
    scheme = menu_option(scheme_name).scheme
    total = bits = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            rows, columns = module.weight.shape
            total += rows * columns
            bits += weight_bits(scheme, rows, columns, module.weight.dtype)
    return bits / total


def recipe(algorithm: str, **fields) -> list:
    """The modifiers of ``algorithm`` with ``fields`` (a scheme or a mixed-precision choice)."""
    if algorithm == "gptq":
        return [GPTQModifier(**fields)]
    if algorithm == "awq":
        return [AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(**fields)]
    return [QuantizationModifier(**fields)]


def run(model_dir: str, dtype: str | None, modifiers: list, batches, windows, out: Path, reference) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    model = llmpress.oneshot(load(model_dir, dtype), modifiers, batches, output_dir=out)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    record = json.loads((out / "config.json").read_text()).get("llmpress_mixed_precision")
    scores = perplexity(model.float(), windows, progress=False, reference=reference)  # both measures in one pass
    return {"ppl": scores.perplexity, "kl": scores.kl_divergence, "mb": size / 1e6, "seconds": seconds, "record": record}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(fixture("tiny-llama")))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the checkpoint's own")
    parser.add_argument("--targets", nargs="+", type=float, default=[3.5, 4.25])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--menu", help="comma-separated (default: the modifier's default menu for each target)")
    parser.add_argument("--uniform", nargs="*", default=list(UNIFORM))
    parser.add_argument("--windows", type=int, default=40, help="held-out windows of 256 tokens (fewer if the text is shorter)")
    parser.add_argument("--algorithm", choices=["gptq", "awq", "rtn"], default="gptq")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = evaluation_windows(fixture("text", "evaluation.txt").read_text(), tokenizer, 256, args.windows)
    base = load(args.model, args.dtype)
    uniform_bits = {name: average_bits(base, name) for name in args.uniform}  # in the stored dtype, before the cast
    dense = perplexity(base.float(), windows, progress=False).perplexity
    work = Path(tempfile.mkdtemp(prefix="mixed-"))
    print(f"{args.model} ({args.dtype or 'its own dtype'}): unquantized perplexity {dense:.3f} on {windows.shape[0]} windows; {args.algorithm} on {args.samples} x "
          f"{args.seq_len} calibration tokens, drawn with seeds {args.seeds}; menu "
          + (args.menu or "; ".join(f"{t}: {','.join(default_menu(t))}" for t in args.targets)))
    rows: dict[str, list[dict]] = {}
    choices: dict[float, list[dict]] = {}
    for seed in args.seeds:
        batches = calibration(tokenizer, args.samples, args.seq_len, seed)
        for name in args.uniform:
            scheme = menu_option(name).scheme.model_copy(update={"targets": ["Linear"]})
            row = run(args.model, args.dtype, recipe(args.algorithm, config_groups={"group_0": scheme}, ignore=["lm_head"]), batches,
                      windows, work / name, base)
            rows.setdefault(f"{name} (uniform)", []).append({**row, "bits": uniform_bits[name]})
        for target in args.targets:
            choice = {"average_bits": target, **({"schemes": args.menu} if args.menu else {})}
            modifiers = recipe(args.algorithm, mixed_precision=choice, targets=["Linear"], ignore=["lm_head"])
            row = run(args.model, args.dtype, modifiers, batches, windows, work / f"mixed-{target}", base)
            record = row["record"]
            choices.setdefault(target, []).append({m: g["chosen"] for g in record["groups"] for m in g["modules"]})
            rows.setdefault(f"mixed, target {target}", []).append({**row, "bits": record["average_bits"]})
        print(f"seed {seed} done: " + ", ".join(f"{k} {v[-1]['ppl']:.3f} (KL {1e3 * v[-1]['kl']:.3f}e-3)" for k, v in rows.items()), flush=True)
    seeds = " | ".join(f"seed {s}" for s in args.seeds)
    print(f"| scheme | bits per weight | file MB | perplexity, {seeds} | mean | rise | KL x 1e3, mean | seconds |")
    print("|---|---|---|" + "---|" * len(args.seeds) + "---|---|---|---|")
    for name, runs in rows.items():
        mean = sum(r["ppl"] for r in runs) / len(runs)
        cells = " | ".join(f"{r['ppl']:.3f}" for r in runs)
        print(f"| {name} | {runs[0]['bits']:.3f} | {runs[0]['mb']:.2f} | {cells} | {mean:.3f} | {mean - dense:+.3f} | "
              f"{1e3 * sum(r['kl'] for r in runs) / len(runs):.3f} | {sum(r['seconds'] for r in runs) / len(runs):.0f} |")
    for target, runs in choices.items():
        used = sorted({c for r in runs for c in r.values()})
        line = f"target {target}: schemes used {', '.join(used)}"
        if len(runs) > 1:
            same = sum(all(r[m] == runs[0][m] for r in runs[1:]) for m in runs[0])
            line += f"; the same scheme under seeds {args.seeds} for {same} of {len(runs[0])} modules ({same / len(runs[0]):.0%})"
        print(line)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
