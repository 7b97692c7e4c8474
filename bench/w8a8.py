"""W8A8 int8 in ``llmpress.load``: prefill and decode against fp32 and bf16, one run.

    python bench/w8a8.py [--tokens 512] [--new-tokens 32] [--work DIR]

On the random 2048-hidden Llama of ``bench/load_and_run.py`` (8 layers, TinyLlama's shapes), it
writes llmpress's W8A8 checkpoint (int8 per-channel weights, dynamic per-token int8 inputs, RTN)
and measures, each in its own process at the machine's thread count:

- prefill: one forward of a ``--tokens`` prompt at batch 1 (median of 3 after a warm-up): fp32 and
  bf16 dense, and the W8A8 checkpoint in ``llmpress.load`` (int8 × int8 on oneDNN from 32 tokens);
- greedy decode tokens/s at batch 1 (the int8-weight kernel on the quantized input);
- logits of the W8A8 runtime against its dequantized view (``dequantize=True``: fp32 weights, the
  same fake-quantized inputs), relative L2 on 2 x 64 random tokens, on this model and on the shared
  tiny trained one. Beside it, the same dense view in float64 against float32: how far float
  rounding alone moves the logits once per-token int8 inputs round differently (on random weights,
  a rounding flip in one layer grows through the next ones);
- each int8 × int8 module's output against float64 arithmetic on the same input (the input
  fake-quantized as the scheme says, the dequantized weight): what the product itself adds, with
  no earlier layer's rounding in it;
- the fp64 and fp32 dense views layer by layer (all tokens, the median token, the worst): after
  the first layer the median token is still at float rounding and a few tokens are not (an int8
  input rounded the other way); by the second, attention has spread that to every token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from common import REPO, fixture, work_folder
from load_and_run import make_random_llama, worker

from llmpress.lifecycle.state import scheme_of


def compress_w8a8(model_dir, output):
    import llmpress

    if not (output / "config.json").exists():
        llmpress.oneshot(model_dir, "W8A8", output_dir=output)
    return output


def logits_gaps(checkpoint, work) -> tuple[float, float]:
    """(runtime vs dense fp32 view, dense fp64 view vs dense fp32 view), relative L2."""
    logits = {}
    for tool in ("llmpress", "llmpress-exact", "llmpress-exact-fp64"):
        worker("logits", "--tool", tool, "--model", str(checkpoint), "--out", str(work / f"{tool}.pt"))
        logits[tool] = torch.load(work / f"{tool}.pt")
    reference = logits["llmpress-exact"]

    def rel(other):
        return float((other - reference).norm() / reference.norm())

    return rel(logits["llmpress"]), rel(logits["llmpress-exact-fp64"])


def per_module_gap(checkpoint, tokens: int = 64) -> float:
    """The largest relative L2 error of an int8 × int8 module's output, each against float64
    arithmetic on the very input it got (one forward of 2 x ``tokens`` random tokens)."""
    import torch.nn.functional as F

    import llmpress
    from llmpress.quant.qdq import fake_quantize_activation

    model, gaps = llmpress.load(checkpoint), []

    def check(module, args, out):
        x = args[0]
        if x.numel() < module.in_features * 32:  # decode-sized inputs take the bf16 kernel
            return
        inputs = scheme_of(module).input_activations
        quantized = fake_quantize_activation(x, inputs, getattr(module, "input_scale", None), getattr(module, "input_zero_point", None))
        reference = F.linear(quantized.double(), module.dequantized_weight(torch.float64))
        gaps.append(float((out.double() - reference).norm() / reference.norm()))

    hooks = [m.register_forward_hook(check) for m in model.modules() if getattr(m, "kernel", None) == "int8x8"]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, tokens)))
    for hook in hooks:
        hook.remove()
    if not gaps:
        raise SystemExit(f"no module of {checkpoint} ran on the int8 x int8 product")
    return max(gaps)


def divergence_by_layer(checkpoint, tokens: int = 64) -> list[tuple[float, float, float]]:
    """How the fp64 and fp32 dense views of one checkpoint drift apart, layer by layer, on the
    tokens of ``logits_gaps``: each decoder layer's output, relative L2 over all tokens, and of
    the median and the worst token. Where the median token of the first layer is at float
    rounding and its worst is not, a per-token int8 input rounded the other way there; that
    token's error then crosses more rounding boundaries in the next quantized inputs, and
    attention hands it to every later token."""
    import llmpress

    outputs = []
    for dtype in (torch.float32, torch.float64):
        model, hidden = llmpress.load(checkpoint, dequantize=True, dtype=dtype), []
        for layer in model.model.layers:
            layer.register_forward_hook(lambda module, args, out: hidden.append((out[0] if isinstance(out, tuple) else out).double()))
        # the tokens of load_worker.py's logits task
        ids = torch.randint(3, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(ids)
        outputs.append(hidden)
        del model
    rows = []
    for low, high in zip(*outputs):
        per_token = ((low - high).norm(dim=-1) / high.norm(dim=-1)).flatten()
        rows.append((float((low - high).norm() / high.norm()), float(per_token.median()), float(per_token.max())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "src"))
    work = work_folder(args.work, "llmpress-bench-w8a8-")
    fp32 = make_random_llama(work / "random-2048")
    w8a8 = compress_w8a8(fp32, work / "random-2048-w8a8")
    rows = {}
    for label, tool, model in [("fp32", "fp32", fp32), ("bf16", "bf16", fp32), ("llmpress W8A8", "llmpress", w8a8)]:
        prefill = worker("prefill", "--tool", tool, "--model", str(model), "--tokens", str(args.tokens))
        decode = worker("decode", "--tool", tool, "--model", str(model), "--new-tokens", str(args.new_tokens))
        rows[label] = {**prefill, "tokens_per_s": decode["tokens_per_s"], "decode_rss_mb": decode["peak_rss_mb"]}
        print(json.dumps({label: rows[label]}), flush=True)
    tiny = compress_w8a8(fixture("tiny-llama"), work / "tiny-w8a8")
    gaps = {"random-2048": (*logits_gaps(w8a8, work), per_module_gap(w8a8)), "tiny": (*logits_gaps(tiny, work), per_module_gap(tiny))}
    drift = divergence_by_layer(w8a8)

    print(f"\nrandom-2048 Llama, batch 1, {torch.get_num_threads()} threads: prefill of {args.tokens} tokens,"
          f" greedy decode of {args.new_tokens} (ratios to fp32)")
    print(f"{'':<15} {'prefill s':>10} {'ratio':>6} {'decode tok/s':>13} {'ratio':>6} {'peak RSS MB':>12}")
    base = rows["fp32"]
    for label, r in rows.items():
        print(f"{label:<15} {r['prefill_s']:>10.2f} {base['prefill_s'] / r['prefill_s']:>5.2f}x"
              f" {r['tokens_per_s']:>13.1f} {r['tokens_per_s'] / base['tokens_per_s']:>5.2f}x {r['decode_rss_mb']:>12.0f}")
    print("\nW8A8 logits against the dequantized view in fp32 (relative L2, 2 x 64 tokens);"
          " last column: the worst int8 x int8 module against float64 on its own input")
    print(f"{'model':<12} {'llmpress.load':>14} {'fp64 view vs fp32 view':>23} {'per module':>11}")
    for name, (gap, floor, module) in gaps.items():
        print(f"{name:<12} {gap:>14.2e} {floor:>23.2e} {module:>11.2e}")
    print("\nrandom-2048: the fp64 view against the fp32 view, each layer's output (relative L2)")
    print(f"{'layer':<6} {'all tokens':>11} {'median token':>13} {'worst token':>12}")
    for index, (whole, median, worst) in enumerate(drift):
        print(f"{index:<6} {whole:>11.2e} {median:>13.2e} {worst:>12.2e}")


if __name__ == "__main__":
    main()
