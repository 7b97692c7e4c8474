"""GPTQ on a mixture-of-experts model: llmpress vs llm-compressor 0.14, same model, recipe and tokens, one run.

    python bench/moe.py [--repeat 3] [--experts 16] [--hidden 512] [--layers 4] [--work DIR]

The model is a randomly initialised Qwen3-MoE (``save_pretrained`` of transformers: experts stored
one per expert, as on the Hub), GPTQ W4A16 in groups of 128 with ``lm_head`` and the routers
ignored, every expert calibrated on every token (both tools' default). Each compression runs in a
process of its own (``bench/gptq_worker.py``): llmpress as the ``llmpress oneshot`` command,
llm-compressor as its ``oneshot`` from Python. Reported: in-process time, wall time, peak RSS, and
the output error of each checkpoint read back through transformers + compressed-tensors (relative
L2 of the logits against the fp32 model on held-out text), with the experts packed in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from common import PEER_PYTHON, fixture, median_run, work_folder
from gptq import calibration_tokens, prepare_peer_runs, run_worker


def make_qwen3_moe(folder: Path, tokenizer_dir: Path, *, hidden: int, experts: int, layers: int) -> Path:
    """A random Qwen3-MoE with the real one's proportions (30B-A3B: hidden 2048, 128 experts, top 8,
    expert MLP 768 = 3/8 hidden), saved as fp32 safetensors once."""
    expert_mlp = expert_width(hidden)
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=expert_mlp,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1), head_dim=64,
        num_experts=experts, num_experts_per_tok=max(experts // 4, 1), max_position_embeddings=512, tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(folder))
    return folder


def expert_width(hidden: int) -> int:
    """3/8 of hidden, rounded to whole groups of 128 (llm-compressor refuses a partial group)."""
    return max(128, round(3 * hidden / 8 / 128) * 128)


def moe_recipe(path: Path) -> Path:
    """llm-compressor's Qwen3-MoE example recipe: W4A16 groups of 128, routers and lm_head dense."""
    path.write_text("""quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head", "re:.*mlp.gate$"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
""")
    return path


@torch.no_grad()
def logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return torch.cat([model(window[None]).logits[0] for window in tokens])


def packed_experts(folder: Path) -> tuple[int, int]:
    """(expert projections stored packed, expert projections) in a checkpoint."""
    from safetensors import safe_open

    names = []
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names += [k for k in f.keys() if ".experts." in k]
    projections = {k.rsplit(".", 1)[0] for k in names if k.endswith((".weight", ".weight_packed"))}
    return sum(1 for k in names if k.endswith(".weight_packed")), len(projections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool (medians shown)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64, help="calibration samples of 256 tokens")
    parser.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    prepare_peer_runs()

    from transformers import AutoTokenizer

    from llmpress.evaluation import evaluation_windows

    work = work_folder(args.work, "llmpress-bench-moe-")
    tiny = fixture("tiny-llama")
    name = f"qwen3moe-{args.hidden}-e{args.experts}-l{args.layers}"
    model = make_qwen3_moe(work / name, tiny, hidden=args.hidden, experts=args.experts, layers=args.layers)
    tokens = calibration_tokens(work / f"tokens-{args.samples}.jsonl", tiny, samples=args.samples)
    recipe = moe_recipe(work / "gptq-moe.yaml")
    windows = evaluation_windows(fixture("text", "evaluation.txt").read_text(encoding="utf-8"),
                                 AutoTokenizer.from_pretrained(str(tiny)), 256, 8)[:8]

    ours_runs, peer_runs = [], []
    for _ in range(args.repeat):  # alternating, back to back: each pair sees the machine in one state
        ours_runs.append(run_worker(Path(sys.executable), "llmpress", recipe, model, tokens, work / f"{name}-llmpress"))
        peer_runs.append(run_worker(PEER_PYTHON, "llmcompressor", recipe, model, tokens, work / f"{name}-llmcompressor"))
        print(json.dumps({"ours": ours_runs[-1], "peer": peer_runs[-1]}), flush=True)
    ours, peer = median_run(ours_runs), median_run(peer_runs)
    ratios = {key: statistics.median(o[key] / p[key] for o, p in zip(ours_runs, peer_runs)) for key in ours}

    reference = logits(model, windows)
    errors, packing = {}, {}
    for tool in ("llmpress", "llmcompressor"):
        out = logits(work / f"{name}-{tool}", windows)
        errors[tool] = float((out - reference).norm() / reference.norm())
        packing[tool] = packed_experts(work / f"{name}-{tool}")

    print(f"\nGPTQ W4A16 g128 on a random Qwen3-MoE: hidden {args.hidden}, {args.experts} experts (top "
          f"{max(args.experts // 4, 1)}), expert MLP {expert_width(args.hidden)}, {args.layers} layers; "
          f"{args.samples} x 256 calibration tokens, all experts calibrated on all tokens")
    header = f"{'':<14} {'llmpress':>10} {'llm-c':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for key, label, fmt in (("compress_s", "in-process s", ".1f"), ("wall_s", "wall s", ".1f"), ("rss_mb", "peak RSS MB", ".0f")):
        print(f"{label:<14} {ours[key]:>10{fmt}} {peer[key]:>10{fmt}} {ratios[key]:>7.2f}")
    print(f"{'logits err':<14} {errors['llmpress']:>10.4f} {errors['llmcompressor']:>10.4f} "
          f"{errors['llmpress'] / errors['llmcompressor']:>7.2f}")
    print(f"{'experts packed':<14} {'%d/%d' % packing['llmpress']:>10} {'%d/%d' % packing['llmcompressor']:>10}")
    print(f"\nmedians of {args.repeat} alternating runs; ratios: llmpress / llm-compressor, median over the pairs;"
          "\nlogits err: relative L2 of the logits against the fp32 model on 8 x 256 held-out tokens, both read"
          " back through transformers + compressed-tensors.")


if __name__ == "__main__":
    main()
