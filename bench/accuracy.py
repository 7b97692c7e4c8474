"""Each tool's best recipe per scheme (issue 44): perplexity on held-out text, time and peak
memory, llmpress against llm-compressor 0.14 on the same recipes and the same tokens.

    python bench/accuracy.py [--model DIR] [--rows w4a16 w3a16 w4a8 nvfp4 w8a8]
                             [--methods gptq awq quip-gptq spinquant-gptq spinquant-r4-gptq autoround ...]
                             [--tools llmpress llm-compressor] [--samples 64] [--seq-len 256] [--iters 200]
                             [--results FILE] [--rerun] [--table-only]

Every (scheme, method, tool) is one recipe, written once as llm-compressor's YAML and given
unchanged to both tools, each run in a process of its own (``accuracy_worker.py``; the peer's in
``.venv-peers``) on a fresh float32 copy of the model (default: the shared tiny trained Llama;
``--model`` a bf16 SmolLM2-135M copy, say), calibrated on ``--samples`` windows of the shared
calibration text, and the perplexity of 40 held-out windows of 256 tokens of the shared
evaluation text measured on the model as the tool leaves it in memory. Weights symmetric in
groups of 128 where every Linear's columns divide, else 64; int activations dynamic per token;
``nvfp4`` the NVFP4 preset (W4A4); ``w8a8`` int8 weights per channel; ``lm_head`` as it is.
Time is the tool's ``oneshot``; memory the worker's peak resident set up to the end of
compression (the model loaded in float32 included; the evaluation's logits, which would outweigh
it, not).

Methods (llm-compressor's recipes of the issue, and what composes them): ``gptq``, ``awq``
(AWQModifier, then QuantizationModifier with the scheme), ``quip-gptq`` (QuIP v + u), ``spinquant-gptq`` (R1 + R2),
``spinquant-r4-gptq`` (R1 + R2 + R4), ``autoround`` (``--iters`` steps of 8 samples), and the
compositions ``quip-autoround``, ``spinquant-autoround``, ``spinquant-r4-autoround``, and
``smoothquant-gptq`` (SmoothQuant at strength 0.8, then GPTQ: llm-compressor's W8A8 example). SpinQuant's transform type is
``hadamard`` for llmpress (its Hadamard matrices of any order 2^k, 12 or 20 times 2^k) and for
llm-compressor where every rotated size is a power of two, else ``random-hadamard`` (its
``hadamard`` takes powers of two only); QuIP keeps its default ``random-hadamard`` in both.

Results are kept, one JSON line per run with its date and commit, in ``--results`` (default
``bench/results/accuracy.jsonl``); a run already there is not repeated unless ``--rerun`` (one that
failed, rather than being refused, is), so a long grid can be measured over several sittings. The tables are printed from that file;
a tool's best is over every recipe measured for it, the compositions included. A results file
keys runs by the model folder's name: a run whose unquantized perplexity differs from the one
filed under that name (another copy of the model) stops before it measures anything.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import PEER_PYTHON, REPO, fixture
from rotation import ROWS, prepare, row_groups

TOOLS = {"llmpress": sys.executable, "llm-compressor": str(PEER_PYTHON)}
METHODS = ("gptq", "awq", "quip-gptq", "spinquant-gptq", "spinquant-r4-gptq", "autoround", "quip-autoround",
           "spinquant-autoround", "spinquant-r4-autoround", "smoothquant-gptq")
DEFAULT_METHODS = METHODS[:6]
SPINQUANT = {"spinquant": ["R1", "R2"], "spinquant-r4": ["R1", "R2", "R4"]}


def scheme_fields(groups: dict) -> dict:
    """A quantizing modifier's scheme fields for one of ``rotation.row_groups``' groups."""
    if "preset" in groups:
        return {"scheme": groups["preset"], "targets": ["Linear"], "ignore": ["lm_head"]}
    return {"config_groups": groups, "ignore": ["lm_head"]}


def recipe(method: str, groups: dict, tool: str, power_of_two: bool, iters: int) -> dict:
    """``method``'s recipe for ``tool``, in llm-compressor's grammar."""
    transform, _, quantizer = method.rpartition("-")
    modifiers: dict = {}
    if transform == "smoothquant":  # llm-compressor's W8A8 example: activations' outliers into the weights
        modifiers["SmoothQuantModifier"] = {"smoothing_strength": 0.8}
    elif transform == "quip":
        modifiers["QuIPModifier"] = {"rotations": ["v", "u"], "transform_type": "random-hadamard"}
    elif transform:
        kind = "hadamard" if tool == "llmpress" or power_of_two else "random-hadamard"
        modifiers["SpinQuantModifier"] = {"rotations": SPINQUANT[transform], "transform_type": kind}
    if quantizer == "gptq":
        modifiers["GPTQModifier"] = scheme_fields(groups)
    elif quantizer == "awq":  # llm-compressor 0.14's AWQ example: the scales, then the scheme's RTN
        modifiers["AWQModifier"] = {"duo_scaling": True, "n_grid": 20}
        modifiers["QuantizationModifier"] = scheme_fields(groups)
    else:
        modifiers["AutoRoundModifier"] = {**scheme_fields(groups), "iters": iters, "batch_size": 8}
    return {"quant_stage": {"quant_modifiers": modifiers}}


def rotated_sizes_power_of_two(model_dir: str) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = (config["hidden_size"], head, config["intermediate_size"])
    return all(size & (size - 1) == 0 for size in sizes)


@functools.cache
def commit() -> str:
    """The commit the run's code is from, read once (the first run's start: a commit made while
    the grid runs is not the code it runs), ``+changes`` where ``src`` differs from it."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    changed = subprocess.run(["git", "status", "--porcelain", "src"], cwd=REPO, capture_output=True, text=True)
    return (done.stdout.strip() or "unknown") + ("+changes" if changed.stdout.strip() else "")


def run_one(tool: str, model: str, data: Path, plan: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(plan, handle, sort_keys=False)
    command = [TOOLS[tool], str(Path(__file__).with_name("accuracy_worker.py")), tool, model, str(data), handle.name]
    done = subprocess.run(command, capture_output=True, text=True)
    Path(handle.name).unlink()
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"failed": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def key(record: dict) -> tuple:
    return tuple(record[k] for k in ("model", "samples", "seq_len", "iters", "row", "method", "tool"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(fixture("tiny-llama")))
    parser.add_argument("--rows", nargs="+", default=["w4a16", "w3a16", "w4a8", "nvfp4", "w8a8"], choices=list(ROWS))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200, help="AutoRound's steps")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "accuracy.jsonl"))
    parser.add_argument("--rerun", action="store_true", help="measure again what the results file already has")
    parser.add_argument("--table-only", action="store_true", help="print the tables from the results file, run nothing")
    args = parser.parse_args()
    commit()  # the code this run starts from
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    base = {"model": name, "samples": args.samples, "seq_len": args.seq_len}
    if not args.table_only:
        measure(args, results, base)
    print_tables(read_results(results), base, args.iters, args.rows, args.methods, args.tools)


def measure(args, results: Path, base: dict) -> None:
    batches, _, group, dense, data = prepare(args.model, args.samples, args.seq_len)
    power_of_two = rotated_sizes_power_of_two(args.model)
    existing = read_results(results)
    done = {key(r) for r in existing if "failed" not in r}  # a run that failed is tried again
    unquantized = {**base, "iters": None, "row": "unquantized", "method": "-", "tool": "-"}
    kept = [r["perplexity"] for r in existing if key(r) == key(unquantized)]
    if kept and abs(kept[-1] - dense) > 1e-5 * dense:  # results are keyed by the folder's name
        sys.exit(f"{args.results} holds unquantized perplexity {kept[-1]:.4f} for '{base['model']}', and "
                 f"{args.model} gives {dense:.4f}: another copy of the model (the bundled bf16 one where "
                 f"../shared is missing?) under the same name. Pass --results another file, or rename the folder.")
    if key(unquantized) not in done or args.rerun:
        append(results, {**unquantized, "perplexity": dense})
    print(f"{args.model}: unquantized perplexity {dense:.3f}; {len(batches)} x {args.seq_len} calibration tokens; "
          f"weights in groups of {group}", flush=True)
    for row in args.rows:
        groups = row_groups(row, group)
        for method in args.methods:
            for tool in args.tools:
                iters = args.iters if "autoround" in method else None
                record = {**base, "iters": iters, "row": row, "method": method, "tool": tool}
                if key(record) in done and not args.rerun:
                    continue
                outcome = run_one(tool, args.model, data, recipe(method, groups, tool, power_of_two, args.iters))
                append(results, {**record, **outcome})
                shown = (f"{outcome['perplexity']:.3f} in {outcome['seconds']:.0f} s, {outcome['peak_mb']:.0f} MB"
                         if "perplexity" in outcome else next(iter(outcome.values())))
                print(f"  {row} {method} {tool}: {shown}", flush=True)


def append(results: Path, record: dict) -> None:
    stamp = {"date": datetime.date.today().isoformat(), "commit": commit()}
    with results.open("a") as handle:
        handle.write(json.dumps({**record, **stamp}) + "\n")


def print_tables(records: list[dict], base: dict, iters: int, rows: list[str], methods: list[str],
                 tools: list[str]) -> None:
    """The best of each tool per scheme, then every method's figure. llmpress's figure is its
    latest run (its code changes between commits; each run is deterministic); a peer's is the
    mean perplexity of all its runs (its code is fixed, and its AutoRound draws samples at
    random, so one run is one draw), with the latest run's time and peak."""
    mine: dict[tuple, dict] = {}
    draws: dict[tuple, list[float]] = {}
    for record in records:  # the latest run of each key wins
        wanted = iters if "autoround" in record["method"] else None
        if all(record[k] == v for k, v in base.items()) and record["iters"] == wanted:
            at = (record["row"], record["method"], record["tool"])
            mine[at] = dict(record)
            if "perplexity" in record and record["tool"] != "llmpress":
                draws.setdefault(at, []).append(record["perplexity"])
    for at, values in draws.items():
        if "perplexity" in mine[at] and len(values) > 1:
            mine[at].update(perplexity=sum(values) / len(values), runs=len(values))
    dense = next((r["perplexity"] for (row, _, _), r in mine.items() if row == "unquantized"), None)
    if dense is None:
        print("no results for this model and calibration yet")
        return
    print(f"\n{base['model']}: unquantized {dense:.3f}; {base['samples']} x {base['seq_len']} calibration tokens; "
          f"AutoRound {iters} steps\n")
    # a tool's best is over every recipe it was measured with (the compositions included); the
    # second table shows the methods asked for and the compositions measured on these rows
    methods = [m for m in METHODS if m in methods or any((row, m, tool) in mine for row in rows for tool in tools)]
    print("| scheme | " + " | ".join(f"{t} best | rise | time | peak memory" for t in tools) + " |")
    print("|---|" + "---|---|---|---|" * len(tools))
    for row in rows:
        cells = []
        for tool in tools:
            measured = [mine[(row, m, tool)] for m in methods if "perplexity" in mine.get((row, m, tool), {})]
            if not measured:
                cells.append("- | | |")
                continue
            best = min(measured, key=lambda r: r["perplexity"])
            runs = f", mean of {best['runs']} runs" if best.get("runs") else ""
            cells.append(f"{best['perplexity']:.3f} ({best['method']}{runs}) | {best['perplexity'] - dense:+.3f} | "
                         f"{best['seconds']:.0f} s | {best['peak_mb']:.0f} MB")
        print(f"| {row.upper()} | " + " | ".join(cells) + " |")
    print("\nEvery method, perplexity " + " / ".join(tools) + " (refused: the tool cannot run the recipe):\n")
    print("| scheme | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for row in rows:
        cells = []
        for method in methods:
            figures = []
            for tool in tools:
                record = mine.get((row, method, tool), {})
                runs = f" ({record['runs']} runs)" if record.get("runs") else ""
                figures.append(f"{record['perplexity']:.3f}{runs}" if "perplexity" in record
                               else "refused" if "refused" in record else "failed" if "failed" in record else "-")
            cells.append(" / ".join(figures))
        print(f"| {row.upper()} | " + " | ".join(cells) + " |")
    dates = sorted({r["date"] for r in mine.values() if "date" in r})
    commits = sorted({r["commit"] for r in mine.values() if "commit" in r})
    print(f"\nmeasured {', '.join(dates)} at {', '.join(commits)}")


if __name__ == "__main__":
    main()
