"""SmoothQuant + GPTQ W8A8 across model families, llmpress vs llm-compressor 0.14: whether each
tool's smoothing keeps the model, where llmpress reads the mappings from the block and
llm-compressor from its table of architectures.

    python bench/smoothing_families.py [--awq] [--families llama gemma2 ...] [--work DIR]

Each family's tiny random model (``tests/architectures.py``: 2 layers, hidden 128) gets activation
outliers: channels 3, 17 and 40 of every norm whose output Linears read take 50x their gain
(``weight``, or ``1 + weight`` for Gemma's norms) and those Linears' columns 1/50, the same
function, the activations of large models. Then, each run in its own process on the same 16 x 64
calibration tokens and the same recipe file: ``sq-gptq`` (``SmoothQuantModifier`` 0.8, then
``GPTQModifier`` W8A8: int8 weights per channel, int8 inputs per token) by both tools, and
``gptq`` (the same without SmoothQuant, what smoothing buys) by llmpress. With ``--awq``:
``awq`` (bench/awq.py's recipe, AWQ then RTN W4A16 group 128) by both, and ``rtn`` by llmpress.

Each checkpoint's logits on 4 x 32 held-out random tokens are compared with the fp32 outlier
model's (relative L2), read two ways: ``llmpress.load`` (its int8 x int8 runtime), and
transformers 5.17 + compressed-tensors 0.19 in llm-compressor's environment (which also gives the
fp32 reference there).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from awq import awq_recipe
from common import PEER_PYTHON, REPO, fixture, work_folder
from gptq import run_worker
from recipes import RECIPES as W8A8_RECIPES

sys.path.insert(0, str(REPO / "tests"))
from architectures import save_tiny  # noqa: E402

FAMILIES = ["llama", "qwen3", "phi3", "cohere", "gemma", "gemma2", "gemma3_text", "gpt2"]
RECIPES = {"sq-gptq": W8A8_RECIPES["sq-gptq-w8a8"], "gptq": W8A8_RECIPES["gptq-w8a8"]}  # the files bench/recipes.py runs
RUNS = [("sq-gptq", "llmpress"), ("sq-gptq", "llmcompressor"), ("gptq", "llmpress")]
AWQ_RUNS = [("awq", "llmpress"), ("awq", "llmcompressor"), ("rtn", "llmpress")]
CHANNELS = (3, 17, 40)


def norm_readers(model: torch.nn.Module, ids: torch.Tensor) -> dict[torch.nn.Module, list[torch.nn.Module]]:
    """Each decoder norm (a module with a 1-D weight) and the Linears (or GPT-2's Conv1D) whose
    input is its very output."""
    from transformers.pytorch_utils import Conv1D

    made: dict[int, torch.nn.Module] = {}
    read: list[tuple[int, torch.nn.Linear]] = []
    keep = []

    def hook(module, args, output):
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            read.append((id(args[0]), module))
            keep.append(args[0])  # alive, so that no later tensor takes its id
        elif getattr(module, "weight", None) is not None and module.weight.dim() == 1 and isinstance(output, torch.Tensor):
            made[id(output)] = module
        keep.append(output)

    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    handles = [m.register_forward_hook(hook) for m in layers.modules()]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    readers: dict[torch.nn.Module, list[torch.nn.Linear]] = {}
    for tensor, linear in read:
        if tensor in made:
            readers.setdefault(made[tensor], []).append(linear)
    return readers


def save_outlier_model(family: str, folder: Path) -> Path:
    """``family``'s tiny model with outlier channels in every norm that Linears read (the same function)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from llmpress.modifiers.smoothing.fold import gain_offset

    if (folder / "config.json").exists():
        return folder
    source = save_tiny(family, folder.with_name(folder.name + "-source"), fixture("tiny-llama"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.randint(3, 4000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        for norm, linears in norm_readers(model, ids).items():
            offset = gain_offset(norm)
            for channel in CHANNELS:
                norm.weight[channel] = (offset + norm.weight[channel]) * 50 - offset
                for linear in linears:  # an input channel: a Linear's column, a Conv1D's row
                    (linear.weight[channel, :] if isinstance(linear, Conv1D) else linear.weight[:, channel]).div_(50)
        change = float((model(ids).logits - before).norm() / before.norm())
    if change > 1e-4:
        raise SystemExit(f"{family}: the outliers changed the model's function ({change:.1e}): a norm read by something else")
    model.save_pretrained(folder)
    for tokenizer_file in source.glob("tokenizer*"):
        (folder / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    return folder


def peer_logits(checkpoint: Path, windows: Path, out: Path) -> torch.Tensor | str:
    """The logits of the first 4 windows through transformers 5.17 + compressed-tensors 0.19, or the error."""
    done = subprocess.run([str(PEER_PYTHON), str(REPO / "bench" / "perplexity_worker.py"), str(checkpoint), str(windows), "--logits", str(out)],
                          capture_output=True, text=True)
    return torch.load(out) if done.returncode == 0 else done.stderr.strip().splitlines()[-1][:80]


def ours_logits(checkpoint: Path, windows: torch.Tensor) -> torch.Tensor:
    import llmpress

    with torch.no_grad():
        return llmpress.load(checkpoint, dtype=torch.float32)(input_ids=windows[:4]).logits.float()


def error(logits: torch.Tensor | str, reference: torch.Tensor) -> str:
    if isinstance(logits, str):
        return logits
    return f"{float((logits - reference).norm() / reference.norm()):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    parser.add_argument("--awq", action="store_true", help="AWQ W4A16 (+ RTN) and RTN alone instead of the W8A8 recipes")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = work_folder(args.work, "llmpress-smoothing-")
    from helpers import token_batches

    tokens = work / "tokens.jsonl"
    tokens.write_text("\n".join(json.dumps({"input_ids": s}) for s in token_batches(16, 64, vocab=4000)))
    windows = torch.tensor(token_batches(8, 32, vocab=4000, seed=7))
    torch.save(windows, work / "windows.pt")
    for name, text in RECIPES.items():
        (work / f"{name}.yaml").write_text(text)
    awq_recipe(work / "awq.yaml", bits=4, symmetric=True)
    (work / "rtn.yaml").write_text(re.sub(r"    AWQModifier:\n(      .*\n)+", "", (work / "awq.yaml").read_text()))

    rows = []
    for family in args.families:
        model = save_outlier_model(family, work / family)
        reference = ours_logits(model, windows)
        peer_reference = peer_logits(model, work / "windows.pt", work / f"{family}-fp32-logits.pt")
        for recipe, tool in AWQ_RUNS if args.awq else RUNS:
            output = work / f"{family}-{recipe}-{tool}"
            try:
                seconds = run_worker(Path(sys.executable) if tool == "llmpress" else PEER_PYTHON, tool, work / f"{recipe}.yaml",
                                     model, tokens, output)["compress_s"]
            except SystemExit as failed:
                rows.append((family, recipe, tool, "-", str(failed).splitlines()[-1][:60], "-"))
                continue
            ours = error(ours_logits(output, windows), reference)
            theirs = peer_logits(output, work / "windows.pt", work / f"{output.name}-logits.pt")
            theirs = error(theirs, peer_reference) if isinstance(peer_reference, torch.Tensor) else peer_reference
            rows.append((family, recipe, tool, f"{seconds:.1f}", ours, theirs))
            print(json.dumps(rows[-1]), flush=True)

    header = f"{'family':<12} {'recipe':<8} {'written by':<14} {'time s':>7} {'logits error, llmpress.load':>28} {'transformers 5.17':>18}"
    print("\n" + header + "\n" + "-" * len(header))
    for family, recipe, tool, seconds, ours, theirs in rows:
        print(f"{family:<12} {recipe:<8} {tool:<14} {seconds:>7} {ours:>28} {theirs:>18}")
    print("\nlogits error: relative L2 against the fp32 outlier model on 4 x 32 held-out tokens;"
          + ("\nawq: AWQ (duo scaling, grid 20) + RTN W4A16 group 128 (bench/awq.py's recipe); rtn: the RTN alone." if args.awq
             else "\nsq-gptq: SmoothQuant 0.8 + GPTQ W8A8; gptq: GPTQ W8A8 alone."))


if __name__ == "__main__":
    main()
