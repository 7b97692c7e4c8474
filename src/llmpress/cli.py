"""``llmpress`` command line: oneshot, train, eval, generate, inspect.

Every error llmpress raises on purpose prints one line (``error: ...``) and exits with status 2;
no traceback unless ``LLMPRESS_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from llmpress.errors import LlmpressError, os_failure

__all__ = ["main", "run"]


def _oneshot(args: argparse.Namespace) -> int:
    from llmpress.data import CalibrationOptions
    from llmpress.entrypoints import oneshot
    from llmpress.modifiers.mixed_precision.modifier import with_command_line_choice
    from llmpress.parallel.distributed import ranks_from_environment
    from llmpress.parallel.fork import forked_ranks, import_before_fork
    from llmpress.recipe import Recipe

    recipe = with_command_line_choice(Recipe.from_any(args.recipe), args.average_bits, args.target_size, args.schemes, args.experts)
    options = CalibrationOptions(
        num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed, batch_size=args.batch_size,
        calibrate_all_experts=args.calibrate_all_experts, device=args.device, split=args.split,
        dataset_config=args.dataset_config, text_column=args.text_column,
        compute_dtype=None if args.compute_dtype == "auto" else args.compute_dtype,
    )
    start = time.perf_counter()
    before = _folder_stamp(args.output)
    if args.ranks > 1:
        import_before_fork(args.model, args.trust_remote_code)  # once, shared by the forked ranks
    # --ranks: this process and its forked ranks; under torchrun: one rank of its process group (on its GPU)
    with forked_ranks(args.ranks), ranks_from_environment(args.device) as main_process:
        oneshot(args.model, recipe, args.dataset, output_dir=args.output, calibration=options, resume=args.resume,
                return_model=False, trust_remote_code=args.trust_remote_code, dtype=_model_dtype(args.dtype),
                model_free=args.model_free, workers=args.workers, overwrite=args.overwrite)
    if not main_process:
        return 0
    if before is not None and _folder_stamp(args.output) == before:
        print(f"nothing to do: {args.output} is the finished checkpoint of this run")
    else:
        print(f"saved {args.output} in {time.perf_counter() - start:.1f}s")
        _print_mixed_choice(args.output)
    return 0


def _print_mixed_choice(output: str) -> None:
    """A mixed-precision run's choice by layer, as ``llmpress inspect`` shows it."""
    config = Path(output) / "config.json"
    if not config.is_file():
        return
    from llmpress.modifiers.mixed_precision.choose import record_of
    from llmpress.modifiers.mixed_precision.report import choice_summary

    record = record_of(json.loads(config.read_text()))
    if record:
        print("\n".join(choice_summary(record)) + f"\n(llmpress inspect {output} --plot choice.png draws it)")


def _model_dtype(name: str) -> str | None:
    """``--dtype``: None for ``auto`` (the checkpoint's own)."""
    return None if name == "auto" else name


def _folder_stamp(path: str) -> tuple[int, int] | None:
    """What changes when a save replaces the folder (a new folder renamed into place)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _train(args: argparse.Namespace) -> int:
    from llmpress.data import CalibrationOptions
    from llmpress.entrypoints import train
    from llmpress.pipelines.training import TrainingOptions

    training = TrainingOptions(
        epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, batch_size=args.batch_size,
        seq_len=args.seq_len, num_samples=args.num_samples, seed=args.seed,
    )
    calibration = CalibrationOptions(num_samples=args.calibration_samples, seq_len=args.seq_len, seed=args.seed)
    start = time.perf_counter()
    train(args.model, args.recipe, args.dataset, output_dir=args.output, teacher=args.teacher, training=training, calibration=calibration,
          trust_remote_code=args.trust_remote_code, dtype=_model_dtype(args.dtype), overwrite=args.overwrite)
    print(f"saved {args.output} in {time.perf_counter() - start:.1f}s")
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def _eval(args: argparse.Namespace) -> int:
    import torch

    from llmpress.evaluation.report import evaluate_models, format_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    results = evaluate_models(args.model, args.dataset, seq_len=args.seq_len, max_windows=args.max_windows, batch_size=args.batch_size,
                              dtype=getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code, tasks=tasks,
                              include_path=args.include_path, limit=args.limit, kl=args.kl)
    if args.plot:
        from llmpress.evaluation.report import plot_results

        plot_results(results, args.plot)
    if args.json:
        payload = results[0] if len(results) == 1 else results
        print(json.dumps(payload))
    elif len(results) == 1 and "perplexity" in results[0] and not tasks:
        row = results[0]
        print(f"{row['model']} ({row['scheme']}): perplexity {row['perplexity']:.3f} over {row['tokens']} tokens ({row['seconds']:.1f}s)")
    else:
        print(format_table(results))
    return 0


class _TokenClock:
    """A transformers streamer that notes when each token arrives (the prompt first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def summary(self, compiled: bool) -> str:
        """The decode rate after the first step, and what the first step cost (it compiles)."""
        steps = [b - a for a, b in zip(self.times[1:], self.times[2:])]  # one per decode step
        if len(steps) < 3:
            return ""
        later = steps[1:]
        steady = sorted(later)[len(later) // 2]
        rate = f"; decode {len(later) / sum(later):.1f} tokens/s after the first step"
        if not compiled:
            return rate
        cost = steps[0] - steady
        if cost < 0.05:  # this process compiled it before
            return rate + "; decode step compiled earlier"
        return rate + f"; the first step compiled the decode ({cost:.1f}s, once per model and cache size)"


def _generate(args: argparse.Namespace) -> int:
    import torch

    from llmpress.errors import CheckpointError
    from llmpress.loading import LlmpressConfig, load
    from llmpress.loading.loader import model_folder, read_tokenizer
    from llmpress.runtime.decode import is_compiled, kernel_report

    config = LlmpressConfig(bits=args.quantize, lm_head=args.quantize_lm_head) if args.quantize else None
    start = time.perf_counter()
    model = load(args.model, quantization_config=config, compile_decode=args.compile, trust_remote_code=args.trust_remote_code)
    loaded = time.perf_counter() - start
    tokenizer = read_tokenizer(model_folder(args.model), args.trust_remote_code)
    if tokenizer is None:
        raise CheckpointError("the model folder has no tokenizer", got=args.model, expected="tokenizer.json / tokenizer_config.json")
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad, streamer=clock)
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    paths = ", ".join(f"{name} x{count}" for name, count in sorted(kernel_report(model).items()))
    print(f"[{new} tokens in {seconds:.2f}s{clock.summary(is_compiled(model))}; loaded in {loaded:.2f}s; linear layers: {paths}]", file=sys.stderr)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from llmpress.loading.inspect import describe_checkpoint

    info = describe_checkpoint(args.path, trust_remote_code=args.trust_remote_code, verify=args.verify)
    status = 1 if info["problems"] else 0
    if args.json:
        print(json.dumps(info, indent=2))
        return status
    print(f"{info['path']}")
    print(f"  model:   {info['architecture']} ({info['model_type']}), {info['parameters']:,} parameters")
    print(f"  format:  {info['format']} ({info['quantization_status']})")
    if info.get("sparsity"):
        print(f"  sparsity: {info['sparsity']}")
    print(f"  size:    {info['size_mb']:.2f} MB in {info['files']} safetensors file(s)")
    for group in info["groups"]:
        targets = group["targets"] if len(group["targets"]) <= 4 else [*group["targets"][:2], f"... {len(group['targets']) - 2} more"]
        print(f"  {group['name']}: {group['summary']} -> {group['modules']} module(s), targets {targets}")
        if group.get("vllm"):
            print(f"    vLLM / transformers: {group['vllm']}")
        if group.get("cpu_paths"):
            print(f"    on this CPU (llmpress.load): {', '.join(f'{k} x{n}' for k, n in sorted(group['cpu_paths'].items()))}")
    if info["ignore"]:
        print(f"  ignored: {', '.join(info['ignore'])}")
    for line in info.get("rotations") or []:
        print(f"  {line}")
    if info["mixed_precision"]:
        from llmpress.modifiers.mixed_precision.report import choice_summary

        for line in choice_summary(info["mixed_precision"]):
            print(f"  {line}")
    if info["autoround"]:
        from llmpress.modifiers.autoround.record import record_summary

        for line in record_summary(info["autoround"]):
            print(f"  {line}")
    if args.plot:
        _plot_choice(info, args.plot)
    if info["recipe"]:
        print("  recipe:")
        for line in info["recipe"].rstrip().splitlines():
            print(f"    {line}")
    checked = "every tensor read" if args.verify else "headers, index and config (--verify reads every tensor)"
    print(f"  checked: {checked}: {len(info['problems']) or 'no'} problem(s)")
    for problem in info["problems"]:
        print(f"    {problem}")
    return status


def _plot_choice(info: dict, png: str) -> None:
    from llmpress.errors import CheckpointError
    from llmpress.modifiers.mixed_precision.report import plot_choice

    if not info["mixed_precision"]:
        raise CheckpointError("--plot draws a mixed-precision choice, and this checkpoint has none", got=info["path"],
                              expected="a checkpoint written with mixed_precision (llmpress oneshot --average-bits ...)")
    print(f"  plot:    {plot_choice(info['mixed_precision'], png)}")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpress", description="Compress language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True)

    oneshot = commands.add_parser("oneshot", help="compress a model with a recipe and calibration data")
    oneshot.add_argument("--model", required=True, help="model folder")
    oneshot.add_argument("--recipe", required=True, help="a scheme name (W4A16, W8A8, FP8_DYNAMIC, NVFP4, W4A16_G32, ...) or a YAML/JSON recipe file")
    oneshot.add_argument("--output", required=True, help="folder to write the compressed checkpoint to")
    oneshot.add_argument("--average-bits", type=_positive_float,
                         help="mixed precision: choose each module's scheme from --schemes so that the quantized weights average "
                         "this many bits (scales included), by their sensitivity on the calibration data")
    oneshot.add_argument("--target-size", help="mixed precision toward a checkpoint of this size (e.g. 60MB) instead")
    oneshot.add_argument("--schemes", help="the menu for --average-bits / --target-size, comma-separated (default: int weight-only "
                         "schemes in groups of 128 and 32 from the target's whole bits up to 4, then W8A16 and DENSE; e.g. "
                         "W4A16,W4A16_G32,W8A16,DENSE for 4.25)")
    oneshot.add_argument("--experts", choices=["shared", "per_block"], help="mixed precision on an MoE: one scheme for every expert "
                         "(shared, the default: what transformers reads) or one per experts block (vLLM and llmpress.load read it)")
    oneshot.add_argument("--dataset", "--data", help="calibration data: text, JSON-lines file, dataset folder, a Hugging Face Hub dataset "
                         "id or llm-compressor's name for one (ultrachat_200k, open_platypus, gsm8k, ...; the local cache first)")
    oneshot.add_argument("--split", help="a Hub dataset's split, sliced as datasets slices it (train_sft[:512])")
    oneshot.add_argument("--dataset-config", help="a Hub dataset's configuration (main, wikitext-2-raw-v1)")
    oneshot.add_argument("--text-column", help="the field holding the text or chat messages (default: text, then messages)")
    oneshot.add_argument("--num-samples", type=_at_least(1), default=64)
    oneshot.add_argument("--seq-len", type=_at_least(1), default=256)
    oneshot.add_argument("--seed", type=int, default=0)
    oneshot.add_argument("--batch-size", type=_at_least(1), default=2, help="samples per calibration forward")
    oneshot.add_argument(
        "--calibrate-all-experts", action=argparse.BooleanOptionalAction, default=True,
        help="MoE: every expert sees every calibration token for its statistics (default: on)",
    )
    oneshot.add_argument("--device", help="where each layer calibrates: cuda, cuda:N or cpu "
                         "(default: a CUDA GPU when there is one; the model stays in host memory)")
    oneshot.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="the dtype each layer calibrates in; the model and its output keep --dtype (default auto: "
                         "the model's, but float32 for bf16 / fp16 on a CPU without bf16 / fp16 matrix units)")
    oneshot.add_argument("--resume", action="store_true",
                         help="go on from the last finished layer of an interrupted run (its work folder: OUTPUT.llmpress-work)")
    oneshot.add_argument("--model-free", action=argparse.BooleanOptionalAction, default=None,
                         help="quantize straight from the checkpoint's shards, without building the model (default: "
                         "whenever the recipe needs no calibration data and the tensor names say what it targets)")
    oneshot.add_argument("--workers", type=_at_least(1), help="threads for --model-free (default: the CPU count, at most 8)")
    oneshot.add_argument("--ranks", type=_at_least(1), default=1,
                         help="calibrate on N ranks of this machine forked from this process, which share its imported "
                         "libraries' memory (torchrun --nproc-per-node N without N imports of torch; the CPU's cores shared "
                         "out unless OMP_NUM_THREADS says otherwise; a GPU each where there are N)")
    oneshot.set_defaults(run=_oneshot)

    training = commands.add_parser(
        "train", help="run a recipe with training stages (pruning schedules, QAT, distillation) and one-shot stages"
    )
    training.add_argument("--model", required=True, help="model folder")
    training.add_argument("--recipe", required=True, help="YAML/JSON recipe file; stages with run_type: train (or training modifiers) train")
    training.add_argument("--dataset", required=True, help="text, JSON-lines file or dataset folder to calibrate and train on")
    training.add_argument("--output", required=True, help="folder for the result; each earlier stage is saved in OUTPUT/<stage>")
    training.add_argument("--teacher", help="teacher checkpoint for distillation (default: the input model)")
    training.add_argument("--epochs", type=_positive_float, help="epochs per training stage (default: the recipe's latest end, else 1)")
    training.add_argument("--max-steps", type=_at_least(1), help="at most this many optimizer steps per training stage")
    training.add_argument("--lr", type=_positive_float, default=1e-4)
    training.add_argument("--batch-size", type=_at_least(1), default=4)
    training.add_argument("--seq-len", type=_at_least(2), default=256)
    training.add_argument("--num-samples", type=_at_least(1), help="training samples (default: all of the dataset)")
    training.add_argument("--calibration-samples", type=_at_least(1), default=64, help="samples for one-shot stages")
    training.add_argument("--seed", type=int, default=0)
    training.set_defaults(run=_train)
    for command in (oneshot, training):
        command.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                             help="the dtype the model is read, calibrated and saved in (default auto: the one its config "
                             "names); statistics accumulate in float32 whatever it is")

    evaluate = commands.add_parser("eval", help="perplexity and lm-eval task scores of one or more checkpoints")
    evaluate.add_argument("--model", required=True, action="append", help="checkpoint folder (repeat to compare)")
    evaluate.add_argument("--dataset", help="text file to measure perplexity on")
    evaluate.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (arc_easy,hellaswag), run on the model "
                          "llmpress.load gives (needs lm-eval: pip install 'llmpress[eval]')")
    evaluate.add_argument("--include-path", help="a folder of your own lm-eval task YAML files")
    evaluate.add_argument("--limit", type=_at_least(1), help="at most this many documents per task")
    evaluate.add_argument("--seq-len", type=_at_least(2), default=256)
    evaluate.add_argument("--max-windows", type=_at_least(1), default=200)
    evaluate.add_argument("--batch-size", type=_at_least(1), default=8)
    evaluate.add_argument("--json", action="store_true", help="print JSON (an object for one model, a list for several)")
    evaluate.add_argument("--plot", help="write a PNG bar chart here: a panel per measure (perplexity, KL, each task)")
    evaluate.add_argument("--kl", action="store_true", help="also the mean KL divergence of each model's next-token distributions "
                          "from the first --model's (give the uncompressed one first): it ranks compressions that perplexity cannot tell apart")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                          help="the dtype the models run in (default float32)")
    evaluate.set_defaults(run=_eval)

    generate = commands.add_parser("generate", help="greedy text generation from a (compressed) checkpoint")
    generate.add_argument("--model", required=True, help="checkpoint folder (compressed-tensors or full precision)")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=_at_least(1), default=32)
    generate.add_argument("--quantize", type=int, choices=[4, 8], help="quantize a full-precision checkpoint while loading")
    generate.add_argument("--quantize-lm-head", action="store_true",
                          help="with --quantize: the output projection too (as llama.cpp does; faster decode, slightly less exact)")
    generate.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                          help="decode through torch.compile with a static cache from the first token (default: once 1024 tokens "
                               "are asked for; the compile takes tens of seconds once and saves a few ms a token on a small model)")
    generate.set_defaults(run=_generate)

    inspect = commands.add_parser("inspect", help="describe a checkpoint: format, schemes, sizes, recipe")
    inspect.add_argument("path", help="checkpoint folder")
    inspect.add_argument("--json", action="store_true")
    inspect.add_argument("--plot", help="write a PNG of a mixed-precision checkpoint's choice (bits and sensitivity by layer) here")
    inspect.add_argument("--verify", action="store_true",
                         help="read every tensor: truncated, zeroed or non-finite data; exit status 1 when something is wrong")
    for command in (oneshot, training, evaluate, generate, inspect):
        command.add_argument("--trust-remote-code", action="store_true",
                             help="run Python code a model folder brings (its auto_map); off by default, never asked for")
    for command in (oneshot, training):
        command.add_argument("--overwrite", action="store_true",
                             help="replace the checkpoint llmpress wrote in OUTPUT (a folder of other files is never replaced)")
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # under torchrun rank 0 reports: the ranks run the same code on shares of one input and warn
    # alike, so the others say only their errors (as ranks forked by --ranks do)
    main_rank = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.ERROR if not main_rank else logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not main_rank:
        warnings.simplefilter("ignore")
    try:
        return args.run(args)
    except (LlmpressError, OSError) as exc:
        if os.environ.get("LLMPRESS_DEBUG"):
            raise
        if isinstance(exc, OSError):
            exc = os_failure(exc, f"llmpress {args.command} could not read or write a file")
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The ``llmpress`` command."""
    sys.exit(main())


if __name__ == "__main__":
    run()
